"""Messages between the front (HTTP) process and the model process, as msgspec structs
sent as msgpack over two ZMQ PUSH/PULL sockets (one each way).

front -> model:  AddRequests, Abort, Query, Shutdown
model -> front:  Ready | StartupFailed (once), then Accepted, Outputs, Failed, QueryResult

Token ids travel; text does not: the front detokenizes (see ``engine_client.py``).
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any, Union

import msgspec

from specserve.core import SamplingParams, StepOutput


class AddRequest(msgspec.Struct, array_like=True):
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    stream: bool = True        # False: the front wants the first token and the end, not each step


class AddRequests(msgspec.Struct, tag=True, array_like=True):
    """One API call's sub-requests, added together or not at all."""

    ticket: int
    requests: list[AddRequest]


class Abort(msgspec.Struct, tag=True, array_like=True):
    rids: list[str]


class Query(msgspec.Struct, tag=True, array_like=True):
    """Call one of the engine's read-mostly methods between steps (QUERY_METHODS)."""

    ticket: int
    method: str


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class Ready(msgspec.Struct, tag=True, array_like=True):
    model_path: str
    tokenizer_path: str
    context_len: int
    vocab_size: int
    pid: int


class StartupFailed(msgspec.Struct, tag=True, array_like=True):
    message: str
    is_config_error: bool


class Accepted(msgspec.Struct, tag=True, array_like=True):
    ticket: int
    error: str | None = None            # a ValueError's message: the client's mistake (HTTP 400)
    is_engine_error: bool = False       # anything else (HTTP 500)


class Outputs(msgspec.Struct, tag=True, array_like=True):
    outputs: list[StepOutput]


class Failed(msgspec.Struct, tag=True, array_like=True):
    """The engine failed while serving these requests; they are gone from the engine."""

    rids: list[str]
    message: str


class QueryResult(msgspec.Struct, tag=True, array_like=True):
    ticket: int
    value: Any = None
    error: str | None = None


QUERY_METHODS = frozenset({"get_server_info", "flush_cache", "kv_usage"})
ToModel = Union[AddRequests, Abort, Query, Shutdown]
ToFront = Union[Ready, StartupFailed, Accepted, Outputs, Failed, QueryResult]

def _encode_other(value: Any) -> Any:
    """Numbers from numpy/torch as Python numbers, anything else msgpack lacks as its str."""
    item = getattr(value, "item", None)
    return item() if callable(item) else str(value)


def plain(value: Any) -> Any:
    """A query's result as msgpack-safe data (tuples become lists, odd types strings)."""
    return msgspec.msgpack.decode(encode(value))


_encoder = msgspec.msgpack.Encoder(enc_hook=_encode_other)
encode = _encoder.encode
decode_to_model = msgspec.msgpack.Decoder(ToModel).decode
decode_to_front = msgspec.msgpack.Decoder(ToFront).decode


@dataclass(frozen=True)
class Endpoints:
    """ZMQ addresses of the two sockets (ipc:// files in a private temporary folder)."""

    to_model: str
    to_front: str

    @classmethod
    def new(cls) -> "Endpoints":
        folder = tempfile.mkdtemp(prefix="specserve-ipc-")
        return cls(f"ipc://{folder}/to_model", f"ipc://{folder}/to_front")

    def remove_files(self) -> None:
        for address in (self.to_model, self.to_front):
            path = address.removeprefix("ipc://")
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        try:
            os.rmdir(os.path.dirname(self.to_model.removeprefix("ipc://")))
        except OSError:
            pass
