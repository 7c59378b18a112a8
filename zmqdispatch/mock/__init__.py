"""The mock engine program (``zmqdispatch mock-engine``): wire-faithful vLLM EngineCore stand-in."""
