"""From a float model to a calibrated quantized one: where quantizers are made and inserted (quantize.py), the
rules that share a scale at joins (rules.py), calibration statistics and ranges (calibration.py, ranges.py), the
ranges kept with a benchmark entry (saved_ranges.py), quantizer state held for one pass (held_state.py), and safe
checkpoints of any model (checkpoint.py). Imports only models.core below it."""
