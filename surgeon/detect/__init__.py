"""Finding attention blocks: by tensor names (checkpoints), ONNX graphs and nn.Module graphs."""
