"""Workloads the benchmarks time and the tests train: models written from their papers, no downloads.

- :mod:`benchmarks.workloads.models`: the seed papers' models (Inception-V3, GNMT, BigLSTM), the
  GPT with tied embeddings, a ResNet, an MLP and a two-tower model, each with size knobs
  (``make(name, size)``);
- :mod:`benchmarks.workloads.vision`: torchvision-style CNNs (ResNet-50, MobileNetV2, DenseNet-121,
  EfficientNet-B0, VGG-11).
"""
