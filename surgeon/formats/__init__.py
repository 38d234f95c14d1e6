"""Weight formats: each module reads tensors and writes a patched copy, nothing else."""
