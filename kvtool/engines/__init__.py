"""Engine releases as data: which transformers / vLLM releases lint checks (`releases`), what each release does
with a config (`facts`: rows with release ranges and citations; `detect`: what each row looks for), and the
`--compat` table (`compat`). Never imports an engine."""
