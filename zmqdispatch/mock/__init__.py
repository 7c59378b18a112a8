"""The mock engine program (``zmqdispatch mock-engine``): wire-faithful vLLM EngineCore and TokenSpeed stand-in.

The program only: the engine-side handshake it dials with and the other test
doubles live in :mod:`zmqdispatch.testing`.
"""
