"""UTILITY payloads of the typed control calls, byte for byte against vLLM's own encoder.

The expected bytes were produced by vLLM 0.32.0's ``MsgpackEncoder`` (the encoder
its ``EngineCoreClient`` sends UTILITY messages with) for
``(client_index=0, call_id=2**63 + 5, method, args)``, where ``add_lora``'s
argument is vLLM's own ``LoRARequest``. ``tests/real_engine/test_real_control.py``
re-runs vLLM's encoder on the same inputs when the vllm venv is installed.
"""

from __future__ import annotations

import pytest

from zmqdispatch.protocol import control
from zmqdispatch.protocol.control import LoRARequest
from zmqdispatch.protocol.versions import EngineVersion
from zmqdispatch.wire import vllm as wire

V = EngineVersion.parse("0.32.0")
CALL_ID = 2**63 + 5

#: name -> (typed call, vLLM's bytes)
GOLDEN = {
    "sleep": (control.sleep(V), "9400cf8000000000000005a5736c6565709201a561626f7274"),
    "sleep0keep": (control.sleep(V, 0, "keep"), "9400cf8000000000000005a5736c6565709200a46b656570"),
    "wake_up_none": (control.wake_up(V), "9400cf8000000000000005a777616b655f757091c0"),
    "wake_up_tags": (control.wake_up(V, ("weights", "kv_cache")),
                     "9400cf8000000000000005a777616b655f75709192a777656967687473a86b765f6361636865"),
    "pause_scheduler": (control.pause_scheduler(V, "wait", False),
                        "9400cf8000000000000005af70617573655f7363686564756c657292a477616974c2"),
    "reset_prefix_cache": (control.reset_prefix_cache(V),
                           "9400cf8000000000000005b272657365745f7072656669785f636163686592c2c2"),
    "add_lora": (control.add_lora(V, LoRARequest(lora_name="adapter", lora_int_id=7, lora_path="/x/y",
                                                 base_model_name="m", load_inplace=True)),
                 "9400cf8000000000000005a86164645f6c6f72619196a76164617074657207a42f782f79a16dc3c2"),
    "add_lora_min": (control.add_lora(V, LoRARequest(lora_name="a", lora_int_id=1, lora_path="/p")),
                     "9400cf8000000000000005a86164645f6c6f72619196a16101a22f70c0c2c2"),
    "remove_lora": (control.remove_lora(V, 7), "9400cf8000000000000005ab72656d6f76655f6c6f72619107"),
    "list_loras": (control.list_loras(V), "9400cf8000000000000005aa6c6973745f6c6f72617390"),
    "collective_rpc": (control.collective_rpc(V, "check_health"),
                       "9400cf8000000000000005ae636f6c6c6563746976655f72706394ac636865636b5f6865616c7468c090c0"),
    "collective_rpc2": (control.collective_rpc(V, "m", timeout=5, args=(1, "x"), kwargs={"k": 2}),
                        "9400cf8000000000000005ae636f6c6c6563746976655f72706394a16dcb40140000000000009201a17881a16b02"),
    "profile": (control.profile(V, True, profile_prefix="run1", max_iterations=4),
                "9400cf8000000000000005a770726f66696c6594c3a472756e31c004"),
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_utility_payload_equals_vllms(name):
    call, expected = GOLDEN[name]
    assert wire.encode_utility_call(0, CALL_ID, call.method, call.args).hex() == expected


def test_profile_leaves_out_trailing_defaults():
    # vLLM's client always sends its four arguments; the engine's defaults are
    # the same None, and leaving them out keeps the call valid on signatures
    # that have fewer parameters.
    assert control.profile(V).args == (True,)
    assert control.profile(V, False, max_iterations=3).args == (False, None, None, 3)
