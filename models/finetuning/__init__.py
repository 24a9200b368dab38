"""QAT of a quantized model: the recipe, the fine-tuner and its losses (finetune.py), the step's plan, compiled or
eager (fast_step.py). Imports models.core and models.quantization."""
