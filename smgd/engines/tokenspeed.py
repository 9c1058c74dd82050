"""TokenSpeed 0.1.1 headless scheduler client: smgd plays the SMG/AsyncLLM front end.

Topology and readiness come from :class:`~smgd.engines.handshake.HandshakeEngineClient`; the
handshake socket must be **tcp** (TokenSpeed only dials ``tcp://{--data-parallel-address}:
{--data-parallel-rpc-port}``). Under attention-DP every DP rank dials with identity
``--zmq-engine-index + dp_rank`` and reports ``data_parallel_size``, so the client waits for
that many ranks.

What TokenSpeed does not do for us, and this client therefore does (the codec's
:func:`~smgd.wire.tokenspeed.encode.encode_add` validates before anything is sent):

- a payload the engine cannot decode is dropped silently (no reply): validate everything first,
  the silence watchdog covers the rest;
- a request smgd aborts never gets a terminal frame: the stream is closed locally;
- a request the engine rejects comes back as a bare ``"abort"``: a Finish with status 400.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from smgd.engines.handshake import Batch, HandshakeEngineClient
from smgd.errors import ConfigError, InvalidRequest
from smgd.wire.common import FinishReason, GenerateRequest
from smgd.wire.tokenspeed.decode import decode_handshake, decode_output, decode_registration
from smgd.wire.tokenspeed.encode import encode_abort, encode_add, encode_init

if TYPE_CHECKING:
    from smgd.config import EngineConfig
    from smgd.wire.common import EngineInfo, EngineRequest, TokenDelta

# TokenSpeed's own default dial target (--data-parallel-address / --data-parallel-rpc-port).
DEFAULT_HANDSHAKE = "tcp://127.0.0.1:30500"


class TokenspeedEngineClient(HandshakeEngineClient):
    wire = "tokenspeed"
    # Its output frames carry only the sampled token's logprob.
    max_top_logprobs = 0

    def __init__(self, config: EngineConfig, *, handshake: str, **kwargs: Any) -> None:
        if not handshake.startswith("tcp://"):
            raise ConfigError(
                f"TokenSpeed only dials a tcp handshake address, not {handshake!r}",
                path=f"$.engines.{config.name}.addresses.handshake",
                hint="e.g. tcp://127.0.0.1:30500",
            )
        super().__init__(config, handshake=handshake, **kwargs)

    def _wire_status(self, payload: bytes) -> str:
        status = decode_handshake(payload).status
        return status or ""

    def _wire_init(self, inputs: list[str], outputs: list[str]) -> list[bytes]:
        return encode_init(inputs, outputs)

    def _wire_registration(self, payload: bytes) -> tuple[EngineInfo, int]:
        reg = decode_registration(payload)
        return reg.engine_info(), reg.data_parallel_size or 1

    def _ranks_hint(self, dp_size: int) -> int:
        # Attention-DP: each DP rank owns request I/O and dials in with its own identity.
        return max(self.expected_ranks, dp_size)

    def _grammar_refusal(self, delta: TokenDelta) -> str | None:
        # Its grammar manager aborts the request with a reason the slim wire drops.
        assert delta.finish is not None
        if delta.finish.reason is FinishReason.ABORT:
            return (
                "the engine refused it (TokenSpeed sends no reason: no grammar backend, or a "
                "grammar it cannot compile)"
            )
        return None

    def _wire_add(self, req: EngineRequest) -> list[bytes]:
        if not isinstance(req, GenerateRequest):  # config refuses task = "embed" here
            raise InvalidRequest("the TokenSpeed wire has no embedding request", param="model")
        return encode_add(req, max_model_len=self.info.max_model_len if self.info else None)

    def _wire_abort(self, rid: str) -> list[bytes]:
        return encode_abort([rid])

    def _wire_outputs(self, frames: list[Any]) -> Batch:
        out = decode_output(frames)
        return Batch(out.deltas, out.engine_index, out.load)


def tokenspeed_argv(
    *,
    python: str,
    model: str,
    args: list[str],
    handshake_host: str = "{handshake_host}",
    handshake_port: str = "{handshake_port}",
    engine_index: int = 0,
) -> list[str]:
    """``ts serve --headless`` dialing smgd's handshake socket.

    The host/port default to placeholders the client fills in once the handshake socket is
    bound. SMG's launcher defaults (#2079) are added unless ``args`` sets them: without
    ``--grammar-backend`` constraints are silently ignored, and without
    ``--enable-output-logprobs`` a logprobs request comes back as a bare abort.
    """
    argv = [
        python, "-m", "tokenspeed.cli", "serve", "--headless", "--model", model,
        "--data-parallel-address", handshake_host,
        "--data-parallel-rpc-port", handshake_port,
        "--zmq-engine-index", str(engine_index),
    ]  # fmt: skip
    if not any(a.startswith("--grammar-backend") for a in args):
        argv += ["--grammar-backend", "xgrammar"]
    if "--enable-output-logprobs" not in args:
        argv.append("--enable-output-logprobs")
    return [*argv, *args]
