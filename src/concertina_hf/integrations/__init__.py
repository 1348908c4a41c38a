"""Optional integrations with other Hugging Face libraries, each imported only when used:

- :mod:`.peft`: ``peft.PeftModel`` (LoRA, ...) through the pipeline; adapter saving and loading.
- :mod:`.trl`: :class:`~concertina_hf.integrations.trl.ConcertinaSFTTrainer`, TRL's ``SFTTrainer``
  dataset preparation (packing, padding-free, completion-only loss) on the pipeline.
"""
