"""``python -m smgd.bench.vllm_mock ARGS``: the vLLM-wire mock engine as a *remote* engine core.

vLLM's front end started with ``--data-parallel-size-local 0`` expects every engine's HELLO and
READY to say ``local: false`` (``wait_for_engine_startup`` rejects anything else), while
:mod:`smgd.mock.vllm` announces itself as local (what smgd's handshake expects). This entry
point runs the same mock with the handshake's ``local`` flag forced off, and answers vLLM's
start-up utility calls (``get_supported_tasks``; anything else gets ``None``), which the mock
does not model and without which the API server never finishes starting. The arguments are
``smgd mock-engine``'s.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from smgd.errors import WireError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from smgd.mock.engine import MockWire
    from smgd.mock.scheduler import MockScheduler


# What the API server asks the engine at start-up, and the answer a generate-only engine gives.
_UTILITY_ANSWERS: dict[str, Any] = {"get_supported_tasks": ["generate"]}


def main(argv: list[str] | None = None) -> int:
    from smgd.mock import main as mock_main
    from smgd.mock.vllm import VllmMockWire
    from smgd.wire import vllm as codec

    class RemoteVllmMockWire(VllmMockWire):
        def on_request(self, frames: Sequence[bytes], sched: MockScheduler) -> list[list[bytes]]:
            try:
                msg = codec.decode_request(frames)
            except WireError:
                msg = None
            if isinstance(msg, codec.UtilityRequest):
                value = _UTILITY_ANSWERS.get(msg.method)
                result = codec.UtilityResult(None, value)
                out = codec.EngineCoreOutputs(
                    engine_index=0, utility_output=codec.UtilityOutput(msg.call_id, None, result)
                )
                return [codec.encode_outputs(out)]
            return super().on_request(frames, sched)

    def build_wire(args: argparse.Namespace) -> MockWire:
        return RemoteVllmMockWire(
            args.handshake, context_len=args.context_len, max_batch=args.max_batch
        )

    hello, ready = codec.encode_hello, codec.encode_ready

    def remote_hello(**kw: Any) -> list[bytes]:
        return hello(**{**kw, "local": False})

    def remote_ready(**kw: Any) -> list[bytes]:
        return ready(**{**kw, "local": False})

    codec.encode_hello = remote_hello
    codec.encode_ready = remote_ready
    mock_main.build_wire = build_wire
    parser = argparse.ArgumentParser(prog="smgd.bench.vllm_mock")
    mock_main.add_mock_args(parser)
    return mock_main.mock_engine_main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
