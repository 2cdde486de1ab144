"""Not torchvision: a stand-in for what cannot run here (test-only; tests/e2e/test_binding_e2e.py).

vLLM 0.32's ``qwen3_5.py`` imports ``qwen3_vl.py``, which imports transformers' Qwen2-VL image
processor, which imports ``torchvision`` at module level. No torchvision wheel for CPU torch 2.13
can be installed here (PyPI's 0.28.0 is a CUDA build: ``torchvision::nms does not exist``), and a
Qwen3.5 text model never calls it. These modules give the names those imports ask for and nothing
else; the dist-info beside them gives transformers a version to compare. Only the Qwen3.5 engine's
PYTHONPATH holds this directory."""
