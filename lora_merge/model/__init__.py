"""What lora-merge knows of models, in one place: the architectures (each a table of layout rules), the
reference config read into a model shape (sizes, MoE, MLA, RoPE), the layout rules and their inverse
(placement), the parallel layouts and layer numbering, and the check of a Megatron run's args against the
model. No file is read or written here but the reference's config.json."""
