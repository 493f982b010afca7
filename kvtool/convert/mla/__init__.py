"""GQA/MHA -> MLA (multi-head latent attention, DeepSeek layout): shape, solve and layout modules."""
