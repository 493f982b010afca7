"""`kvtool convert --to mla`, writing (the plan is kvtool/convert/mla/plan.py's): `write_mla(plan, dst)` calibrates
(`calibrate`: one forward of the source model that solves each attention layer as it reaches it, the solved
layers waiting on disk in a kvtool.convert.aware.spill.LayerStore), then streams the source once: each attention
layer's MLA block where its q_proj was, every other tensor copied file to file."""

from __future__ import annotations

import json
from pathlib import Path

from kvtool.convert import defaults
from kvtool.convert.mla.plan import MlaPlan, served_horizon
from kvtool.convert.targets import ConversionResult
from kvtool.errors import InputError


def write_mla(p: MlaPlan, dst: str | Path, *, verify, force: bool = False, progress: bool | None = None,
              device: str = "cpu") -> ConversionResult:
    """Calibrate, then stream the source once: each attention layer solved into its MLA block, every other tensor
    copied file to file (cast when --dtype asks), written to a staged folder renamed to `dst` when complete."""
    from kvtool import __version__
    from kvtool import progress as kv_progress
    from kvtool.convert.config_edit import dump_config
    from kvtool.io.outputfile import identities, write_new
    from kvtool.io.reader import CheckpointReader, st_to_torch_dtype
    from kvtool.io.staging import check_destination, copy_side_files, staged_output
    from kvtool.io.writer import ShardWriter

    dst = Path(dst)
    check_destination(dst, force=force, protect=[p.src])
    with CheckpointReader(p.src, expect=identities(p.ckpt.headers)) as reader:
        solved, solve_info = calibrate(p, reader, device)

        out_dtypes = {t.name: t.dtype for t in p.outputs}
        layer_of = {names["q_proj.weight"]: i for i, names in p.layers.items()}
        attn = {n for names in p.layers.values() for n in names.values()}
        meta = {"kvtool_version": __version__, "kvtool_source_hash": p.source_hash, "kvtool_method": "mla",
                "kvtool_kv_heads": f"{p.source_kv_heads}->mla{p.shape.kv_lora_rank}+{p.shape.qk_rope_head_dim}"}
        with staged_output(dst, force=force, protect=[p.src], verify=verify) as tmp:
            bar = kv_progress.task("convert", total=len(p.outputs), unit="tensors", enabled=progress)
            try:
                with ShardWriter(tmp, p.max_shard_size, meta, plan=p.outputs, background_copies=True,
                                 sources=reader.identities) as writer:
                    def copy(out_name: str, src_name: str) -> None:
                        if out_dtypes[out_name] == reader.info(src_name).dtype:
                            writer.copy_from(out_name, *reader.byte_range(src_name))
                        else:
                            t = reader.get(src_name).to(st_to_torch_dtype(out_dtypes[out_name]))
                            writer.add(out_name, t)
                        bar.update(1)

                    for name in reader.names():
                        if name in layer_of:
                            i = layer_of[name]
                            new = solved.take(i)
                            for key, out_name in p.out_layers[i].items():
                                writer.add(out_name, new[key].detach().to("cpu").contiguous().to(
                                    st_to_torch_dtype(out_dtypes[out_name])))
                                bar.update(1, note=f"layer {i}")
                        elif name not in attn:
                            copy(name, name)
                    for out_name, src_name in p.copies.items():
                        copy(out_name, src_name)
                    result = writer.finalize()
            finally:
                bar.close()
                solved.close()
            write_new(tmp / "config.json", dump_config(p.new_config))
            side = copy_side_files(p.src, tmp)
            prov = p.provenance(solve_info)
            prov["files"] = result.files
            write_new(tmp / "kvtool.json", json.dumps(prov, indent=2) + "\n")
    return ConversionResult(plan=p, dst=dst, files=result.files, side_files=side, provenance=prov)


def calibrate(p: MlaPlan, reader, device: str = "cpu") -> tuple:
    """The calibration ids (kvtool.convert.aware.calibration_data: --calib-text / --calib-dataset, the aware
    merge's default mix), then one forward of the source model (kvtool.convert.mla.stats.collect_stats) that
    solves each attention layer as it reaches it (and refines it, --refine-steps) and goes on with the converted
    layer's output; then --distill-steps (kvtool.convert.mla.train). Returns (the solved layers, waiting on disk
    in a kvtool.convert.aware.spill.LayerStore, and kvtool.json's record of the solve)."""
    import torch

    from kvtool import progress as kv_progress
    from kvtool.convert.aware.calibration_data import CalibrationData
    from kvtool.convert.aware.method import DISTILL_LR, REFINE_TARGETS
    from kvtool.convert.aware.spill import LayerStore
    from kvtool.convert.mla import solve
    from kvtool.convert.mla.layout import check_solved
    from kvtool.convert.mla.rope import SourceRope
    from kvtool.convert.mla.stats import collect_stats
    from kvtool.datasets import MERGE_CALIBRATION, check_calibration_source
    from kvtool.io.staging import sigterm_as_interrupt
    from kvtool.runtime.layerwise import open_layerwise

    s = p.settings
    check_calibration_source(s["calib_text"], s["calib_dataset"])
    dataset = s["calib_dataset"] or (None if s["calib_text"] else MERGE_CALIBRATION)
    rope = SourceRope.of_config(p.spec.config)
    solved = LayerStore("kvtool-mla-", "the solved layer {layer}")  # each read back once, by the writer
    refine_steps, distill_steps = s["refine_steps"], s["distill_steps"]
    if refine_steps or distill_steps:
        from kvtool.convert.mla import train
    # refinement fits the source attention on the converted stream: the aware merge's `layer` target and step
    refine_lr = REFINE_TARGETS["layer"]
    per_layer = 1 + refine_steps  # one unit per layer: its solve and each refinement step equal parts
    bar = kv_progress.task("calibrate", total=len(p.layers), unit="layers")
    refined: dict[int, dict] = {}
    distilled: dict = {}
    try:
        data = CalibrationData.build(p.src, s["calib_text"], dataset, s["calib_tokens"], s["seq_len"],
                                     device=torch.device(device), note=bar.set_note)

        options = solve.SolveOptions(horizon=served_horizon(s, p.spec), **defaults.MLA_SOLVES[s["mla_solve"]])

        def convert(layer: int, stats):
            weights = {k: reader.get(n).float() for k, n in p.layers[layer].items()}
            tensors = solve.solve_layer(weights, stats, p.shape, rope, options)
            bar.update(1 / per_layer, note=f"layer {layer} solved")
            if refine_steps:
                step = [0]

                def on_step():
                    step[0] += 1
                    bar.update(1 / per_layer, note=f"layer {layer}, refinement step {step[0]}/{refine_steps}")

                tensors, refined[layer] = train.refine_layer(
                    tensors, stats, p.shape, rope, steps=refine_steps, lr=refine_lr, norm=options.norm,
                    o_ridge=options.o_ridge, device=device, on_step=on_step)
            check_solved(tensors, p.shape, layer)
            solved.put(layer, tensors)
            return lambda x: solve.mla_output(x, tensors, p.shape, rope)

        with sigterm_as_interrupt(), open_layerwise(p.src, device=device, dtype=torch.float32, reader=reader,
                                                     layerwise=False) as lm:
            teacher = None
            if distill_steps:
                from kvtool.convert.aware.distill import teacher_targets

                bar.set_note("the source model's next-token distributions")
                teacher = teacher_targets(lm, train.source_hidden(lm, data.ids))
            bar.set_note(f"the source model over {data.ids.numel()} calibration tokens")
            collect_stats(lm.model, data.ids, convert=convert)
            if distill_steps:
                bar.close()
                from kvtool.convert.aware.distill import distill_with_progress

                # the layers kept in `solved` are replaced when the KL fell
                distilled = distill_with_progress(lm, data.ids, teacher, solved.peek, solved.put,
                                                  block=train.MlaBlock(p.shape, rope, options.norm),
                                                  steps=distill_steps, lr=DISTILL_LR)
    except BaseException:
        solved.close()
        raise
    finally:
        bar.close()
    missing = sorted(set(p.layers) - solved.layers)
    if missing:
        solved.close()
        raise InputError(f"layer {missing[0]}: not solved (the calibration forward did not reach its attention "
                         "module)", field="architectures")
    info = {**data.provenance(), "horizon": options.horizon, "options": dict(vars(options)),
                   **getattr(solve, "provenance", lambda: {})()}
    if refine_steps:
        info["refine"] = {"steps": refine_steps, "lr": refine_lr, "target": "layer",
                                 "loss_start": [round(refined[i]["loss_start"], 6) for i in sorted(refined)],
                                 "loss_end": [round(refined[i]["loss_end"], 6) for i in sorted(refined)]}
    if distilled:
        info["distill"] = {"steps": distill_steps, "lr": DISTILL_LR, **distilled}
    return solved, info
