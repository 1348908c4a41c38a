"""Optional integrations with other Hugging Face libraries, each imported only when used:

- :mod:`.peft`: ``peft.PeftModel`` (LoRA, ...) through the pipeline; adapter saving and loading.
"""
