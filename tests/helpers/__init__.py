"""What the tests share: tiny models, judges of what a checkpoint computes, fake servers, CLI runners.

tests/conftest.py puts tests/ on sys.path, so a test anywhere under tests/ imports ``from helpers.x import y``.
"""
