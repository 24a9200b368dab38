"""A quantized model run and measured where it is deployed: Q/DQ ONNX export (export.py), runners for PyTorch,
ONNX Runtime and TensorRT (runners.py), the one evaluation loop (evaluate.py). Imports models.core and
models.quantization; models/pipeline.py and models/mixed_precision.py compose the stages."""
