"""``zmqdispatch serve-grpc``: a gRPC servicer (``vllm.grpc.engine.VllmEngine``,
``tokenspeed.grpc.scheduler.TokenSpeedScheduler`` of ``smg-grpc-proto``) backed
by zmqdispatch over ZMQ, for gateways that reach Python workers over gRPC.

Sans-IO parts, importable without grpcio: :mod:`.status` (zmqdispatch errors
to gRPC status names), :mod:`.facts` (what GetModelInfo, GetServerInfo and
GetLoads answer), :mod:`.tokenizer_zip` (the GetTokenizer bundle),
:mod:`.generate` (one Generate call: translation, responses, the abort
completes). The grpc.aio shell over :mod:`zmqdispatch.aio` is
:mod:`.server` (needs the ``grpc`` extra). ``docs/grpc.md`` describes the
command and every RPC.
"""
