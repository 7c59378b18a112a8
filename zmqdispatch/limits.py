"""Every size and time limit of zmqdispatch, in one place.

Each limit is a named default with the reason it has the value it has (h11
style). The connection-level ones are copied into :class:`zmqdispatch.ClientConfig`
and can be changed per connection; the decoder ones bound what hostile engine
bytes can make us allocate.
"""

from __future__ import annotations

# ---------------------------------------------------------------- decoding engine bytes

#: Largest output frame (msgpack body or aux buffer) we accept, in bytes. pyzmq
#: has already allocated the frame when we see it, so this is enforced with the
#: socket option ``MAXMSGSIZE`` on the output PULL (libzmq drops the peer
#: connection for a bigger message: the client sees the drop on the socket's
#: monitor and fails, with ``RemoteProtocolError`` naming this limit, every
#: request and utility call whose output may have been on it; see
#: ``OUTPUT_DROP_GRACE``) and re-checked by the decoder. A real
#: engine's step message is a few KiB per request; prompt logprobs of a long
#: prompt with k=20 are ~ 8 * P * 21 bytes, so 256 MiB leaves ample room.
MAX_FRAME_BYTES = 256 * 1024 * 1024

#: Largest element count a tensor header (``[dtype, shape, data]``) may claim.
#: A shape is checked against the bytes actually present, so a lying header
#: cannot make us allocate; this bound only rejects absurd shapes early.
MAX_TENSOR_ELEMENTS = 64 * 1024 * 1024

#: Default limit on the multimodal tensor bytes of one request
#: (``TranslationConfig.max_mm_bytes``), refused before anything is encoded: a
#: preprocessed image is a few MB (Qwen2-VL at 1344x1344: 2,304 patches x 1,176
#: float32 = 10.8 MB), so 128 MiB leaves room for many images and short videos
#: while bounding the memory one request pins until it is sent.
DEFAULT_MAX_MM_BYTES = 128 * 1024 * 1024

#: Default limit on multimodal items (placeholders) of one request
#: (``TranslationConfig.max_mm_items``).
DEFAULT_MAX_MM_ITEMS = 64

#: Largest row count (product of the dimensions before the first 0) of a
#: zero-size tensor. It holds no bytes, so nothing else bounds the empty lists
#: a decode would build; vLLM sends ``[0, K+1]`` or ``[0, 0]`` for "no rows".
MAX_EMPTY_TENSOR_ROWS = 64

#: Largest nesting depth of a structured-output JSON schema (vLLM 0.32's
#: ``MAX_STRUCTURED_OUTPUT_JSON_NESTING``); deeper ones are refused, not recursed into.
MAX_JSON_NESTING = 64

#: Largest number of outputs in one ``EngineCoreOutputs`` (vLLM's
#: ``max_num_seqs`` is typically 256-1024).
MAX_OUTPUTS_PER_MESSAGE = 65_536

#: Largest number of new tokens in one ``EngineCoreOutput`` (speculative decoding
#: emits a handful; more means a broken peer).
MAX_TOKENS_PER_TICK = 4096

#: Most samples (``n``) one request may fan out into. vLLM's own bound
#: (``VLLM_MAX_N_SEQUENCES``) is 16,384; every sample is a full engine
#: request, so we keep a gateway-sized bound.
MAX_PARALLEL_SAMPLES = 128

#: vLLM's default ``ModelConfig.max_logprobs``: an engine started without
#: ``--max-logprobs`` sends ENGINE_CORE_DEAD for a larger logprob count.
DEFAULT_MAX_LOGPROBS = 20

#: Largest token id (and token count) an engine output may carry: the gateway
#: protos carry token ids as uint32.
MAX_TOKEN_ID = 2**32 - 1

#: Seconds TokenSpeed keeps an ABORT for a request id it does not know (it
#: arrived after the request finished) and applies it to the next request with
#: that id, without any output (TokenSpeed 0.1.1 ``request_handler``,
#: ``docs/tokenspeed-wire.md`` §1.11). A request reusing such an id within this time
#: travels under a fresh engine-side id (``EngineProtocol.submit``).
TOKENSPEED_ABORT_PARK_SECONDS = 300.0

#: Most such parked-abort ids remembered per TokenSpeed connection (oldest
#: forgotten first). They only arise when an abort races a request's finish.
MAX_PARKED_ABORT_IDS = 65_536

#: Most recently aborted engine-side request ids remembered per connection
#: (oldest forgotten first). Outputs the engine sent before it saw an ABORT are
#: still on their way, and nothing on the wire marks their end; a request that
#: reuses such an id is therefore sent under a fresh engine-side id, so those
#: late outputs can never reach it (``EngineProtocol.submit``).
MAX_ABORTED_IDS = 65_536

# ---------------------------------------------------------------- connection defaults

#: Seconds allowed for the whole HELLO / INIT / READY / ready-response exchange.
#: A real engine loads its model between INIT and READY; vLLM's own default is
#: 600 s (``VLLM_ENGINE_READY_TIMEOUT_S``) and warm-ups of over 10 min exist
#: (vllm PR #27444), so it is configurable.
DEFAULT_HANDSHAKE_TIMEOUT = 600.0

#: Seconds one input send may wait on a full pipe (the engine stopped reading)
#: before the engine is declared dead (``reason="send_timeout"``). The reference
#: gateway uses 10 s (``docs/reference-gateway-lessons.md`` lesson 4: an unbounded
#: send froze the whole client).
DEFAULT_SEND_TIMEOUT = 10.0

#: Most engine handshakes a many-engine client (``zmqdispatch.multi``) runs at
#: once; a HELLO from a new identity past it is refused (logged at WARNING) and
#: the engine may dial again. Each pending handshake binds a socket pair and
#: its two monitors (about 10 file descriptors) and lasts until READY, which a
#: real engine sends only after loading its model (minutes; up to
#: ``handshake_timeout``), so a flood of HELLOs from made-up identities would
#: otherwise bind sockets without bound. 64 (about 640 fds) stays under the
#: usual 1024 soft limit; at startup the cap is at least ``data_parallel_size``,
#: since all ranks of a DP group dial at once.
MAX_PENDING_HANDSHAKES = 64

#: Messages queued towards one engine before sends block (``SNDHWM``); with
#: ``ROUTER_MANDATORY`` a full pipe gives EAGAIN instead of a silent drop.
DEFAULT_SEND_HWM = 10_000

#: Seconds without any output message, while requests are in flight, after which
#: the engine is declared dead (``reason="silence"``). SIGKILL or OOM sends no
#: sentinel and a bound PULL never errors when its PUSH peer vanishes, so
#: silence is the only signal for an engine we did not spawn. SMG uses 300 s; a
#: first token can legitimately take long on a cold engine.
DEFAULT_SILENCE_TIMEOUT = 300.0

#: Consecutive undecodable output messages that mean "schema mismatch or broken
#: engine" (the reference gateway uses 3: ``docs/reference-gateway-lessons.md`` lesson 16).
DEFAULT_MAX_DECODE_ERRORS = 3

#: Tokens buffered for one stream whose consumer is not reading, before only
#: that request is failed with ``SlowConsumerError`` and aborted. vLLM's
#: collector merges without bound; one stuck client must not pin memory.
DEFAULT_MAX_PENDING_TOKENS = 64 * 1024

#: Seconds a utility call waits for its reply.
DEFAULT_UTILITY_TIMEOUT = 30.0

#: Output messages drained from the PULL socket before the pump yields to other
#: tasks (``docs/trio-and-zmq.md`` §2.1, case 5: an unbounded drain starves everyone).
RECV_BATCH_LIMIT = 256

#: Input messages handed to the socket in one go before the input pump yields
#: (one scheduler pass per message starved admission under heavy output; an
#: unbounded burst would starve everyone else instead).
SEND_BURST_LIMIT = 256

#: Seconds of input-pump work (encoding ADDs, handing messages to the socket)
#: in one scheduler pass before it yields. An ADD costs tens of µs to encode: a
#: thousand requests entering at once would otherwise hold the output pump, and
#: every running stream, for tens of milliseconds (``benchmarks/README.md``).
SEND_SLICE_SECONDS = 0.001

#: ... or this share of the time the rest of the event loop took while the
#: input pump yielded, when that is longer (``client.send_slice``): under a
#: saturated engine's output a pass lasts tens of milliseconds, and a 1 ms
#: slice per pass would let admission fall far behind.
SEND_SLICE_SHARE = 0.25

#: Seconds we wait for a spawned engine to exit after SIGTERM before SIGKILL.
#: vLLM's EngineCore takes 4-5 s to shut its worker down gracefully.
DEFAULT_TERMINATE_GRACE = 8.0

#: Most request ids an :class:`~zmqdispatch.client.EngineSession` carries as
#: possibly still running on the engine (``orphan_ids``): requests whose ADD had
#: reached the socket, and ABORTs not yet sent, when the link died (a
#: ``send_timeout`` death leaves a frozen engine with every ADD it had received).
#: ``connect(resume=session)`` ABORTs them before anything else, in one frame.
#: Beyond the bound the most recent ids are kept (the older ones have had the
#: most time to finish); the rest run to their ``max_tokens`` on the engine.
#: 65,536 ids of ~40 bytes make a ~2.6 MB ABORT frame.
MAX_ORPHAN_IDS = 65_536

#: Seconds the output pump waits after the engine's output connection dropped
#: (libzmq closes it itself for a frame above ``MAX_FRAME_BYTES``; a dying engine
#: closes it too) for a death signal (input disconnect, process exit) before it
#: fails the requests whose outputs may be lost with ``RemoteProtocolError``.
#: A dying engine's other signals arrive within milliseconds; the grace keeps
#: its streams failing with ``EngineDeadError`` as for any other death.
#: The other way round too: after an input disconnect, a process exit or
#: EHOSTUNREACH, the pump reads on for at most this long, until the output
#: connection drops as well, so the engine's last outputs (and its sentinel)
#: are routed before the death is declared.
OUTPUT_DROP_GRACE = 0.25

#: Seconds an engine may be without an output connection after a drop before
#: it is declared dead (``reason="output_disconnected"``; only with
#: ``ClientConfig.death_on_disconnect``): an engine that cannot send outputs
#: serves nothing, and new requests would wait for ``silence_timeout``.
#: libzmq's PUSH reconnects 100 ms after a drop (``ZMQ_RECONNECT_IVL``), so a
#: live engine is back well within it.
OUTPUT_RECONNECT_GRACE = 2.0
