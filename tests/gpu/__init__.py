"""Conformance tests of the CUDA adapter; every test is marked `gpu` and skips without CUDA."""
