"""A thin typed layer over tritonclient.grpc: requests, responses, streams, and errors as one line."""

from __future__ import annotations

import queue
import socket
import ssl
import time
from typing import Any

import numpy as np

from torchship.errors import AccessError, ClientError, ServerError, ShapeError

from .access import Access, access_for, refusal_hint


class TritonClient:
    """gRPC client for one Triton server. Errors become ClientError (request refused), AccessError (a control
    call refused for want of the key) or ServerError (server unreachable), each with the server's own message.
    ``access``: the key and TLS files to present (default: access_for(url))."""

    def __init__(self, url: str, timeout_s: float = 60.0, access: Access | None = None):
        import tritonclient.grpc as grpcclient

        self.url = url
        self.timeout_s = timeout_s
        self.access = access if access is not None else access_for(url)
        self.access.check_transport(url)  # before any connection
        self.client = grpcclient.InferenceServerClient(
            url, channel_args=CHANNEL_OPTIONS, creds=self.access.credentials()
        )
        self._configs: dict[str, dict[str, Any]] = {}
        self._channel, self._model_infer = infer_channel(url, self.access)

    @property
    def control_headers(self) -> dict[str, str] | None:
        """The metadata of a control call (model load and unload, repository index, logging): the key."""
        return self.access.grpc_headers()

    def _call(self, what: str, fn, *args, **kwargs):
        from tritonclient.utils import InferenceServerException

        try:
            return fn(*args, **kwargs)
        except InferenceServerException as e:
            status, msg = str(e.status() or ""), e.message().strip()
            if "protocol is restricted" in msg:
                raise AccessError(f"{what}: {refusal_hint(self.url, self.access)}") from None
            unreachable = "UNAVAILABLE" in status or "failed to connect" in msg.lower() or "connect" in status.lower()
            raise self._refused(what, unreachable, msg) from None

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Wait until the server says it is ready. A URL where something answers but not as a gRPC server
        (Triton's HTTP or metrics port, the usual slip) is refused after two tries, naming that."""
        from tritonclient.utils import InferenceServerException

        deadline = time.monotonic() + timeout_s
        silent = False  # the last try: connected, but no answer came in time
        hung_up = 0  # tries in a row where the connection was accepted, then closed on gRPC's preface
        while True:
            left = deadline - time.monotonic()
            try:  # each try is bounded: a listener that never answers would hold the call for 20 s
                if self.client.is_server_ready(client_timeout=max(0.2, min(2.0, left))):
                    return
                silent, hung_up = False, 0
            except InferenceServerException as e:
                said = f"{e.status()} {e.message()}"
                if "handshake failed" in said.lower():  # TLS: the certificates do not fit, and waiting will not help
                    why = said[said.lower().index("handshake failed") :].split(",")[0].strip()
                    raise AccessError(
                        f"no TLS connection to {self.url} ({why}): check that --tls-ca is the CA that "
                        "signed the server's certificate, and give --tls-cert and --tls-key if the server "
                        "asks for a client certificate"
                    ) from None
                hung_up = hung_up + 1 if "Socket closed" in said else 0
                if (
                    hung_up == 2 and self.access.tls
                ):  # twice, so that a gRPC server closing one connection is not taken for it
                    raise AccessError(
                        f"no TLS connection to {self.url}: check that --tls-ca is the CA that signed the "
                        "server's certificate (whose subjectAltName must name the --url host), and give "
                        "--tls-cert and --tls-key if the server asks for a client certificate"
                    ) from None
                if hung_up == 2 and speaks_tls(self.url):
                    raise AccessError(
                        f"{self.url} serves gRPC over TLS: give --tls-ca with the CA that signed its "
                        "certificate (and --tls-cert and --tls-key if it asks for a client certificate)"
                    ) from None
                if hung_up == 2:
                    raise ServerError(
                        f"{self.url} is not a gRPC endpoint: something there accepts connections "
                        "but hangs up on gRPC (Triton's HTTP or metrics port, or a TLS endpoint?); "
                        "--url takes Triton's gRPC port (8001 in the official container, printed "
                        "by torchship serve)"
                    ) from None
                silent = "DEADLINE_EXCEEDED" in said
            except Exception:
                silent, hung_up = False, 0
            if time.monotonic() > deadline:
                if silent:
                    raise ServerError(
                        f"no gRPC answer from {self.url} within {timeout_s:.0f}s: something accepts "
                        "connections there but does not answer; is it Triton's gRPC port?"
                    )
                raise ServerError(f"Triton at {self.url} is not ready after {timeout_s:.0f}s; is the server running?")
            time.sleep(0.2)

    def live(self, timeout_s: float = 1.0) -> bool:
        """Whether the server answers as live within ``timeout_s`` (False, not an error, when it does not)."""
        try:
            return bool(self.client.is_server_live(client_timeout=timeout_s))
        except Exception:  # not up yet, or not a gRPC server
            return False

    def load(self, model: str, config=None, timeout_s: float | None = None) -> None:
        """Load (or reload) ``model``: with ``config`` (a ModelConfig) as the config Triton uses, else with the
        repository's. Bounded by ``timeout_s`` where given. ClientError carrying Triton's message if it fails.
        The config this client read of it before is dropped: a reload may serve another."""
        from google.protobuf import json_format

        self._configs.pop(model, None)

        self._call(
            f"load {model}",
            self.client.load_model,
            model,
            headers=self.control_headers,
            config=json_format.MessageToJson(config) if config is not None else None,
            client_timeout=timeout_s,
        )

    def unload(self, model: str) -> None:
        """Unload every version of ``model`` (requests in flight complete first)."""
        self._configs.pop(model, None)
        self._call(f"unload {model}", self.client.unload_model, model, headers=self.control_headers)

    def repository_index(self) -> list[dict[str, Any]]:
        """The repository's models and their states: a control call, presenting the key where there is one."""
        index = self._call(
            "repository index", self.client.get_model_repository_index, headers=self.control_headers, as_json=True
        )
        return index.get("models", [])

    def ready(self, model: str, version: str = "") -> bool:
        """Whether ``model`` (one version of it, where given) is ready for requests."""
        return bool(self._call(f"model {model}", self.client.is_model_ready, model, str(version)))

    def ready_models(self) -> list[str]:
        """The models loaded and ready, read from the statistics, which answer without the control key."""
        stats = self._call("statistics", self.client.get_inference_statistics, as_json=True)
        return sorted({m["name"] for m in stats.get("model_stats", [])})

    def require_models(self, wanted=()) -> list[str]:
        """The ready models; ClientError naming each of ``wanted`` that is not among them, and what is served."""
        ready = self.ready_models()
        missing = [m for m in wanted if m not in ready]
        if missing:
            raise ClientError(
                f"model {', '.join(missing)} is not served at {self.url} (served: {', '.join(ready) or 'none'})"
            )
        return ready

    def config(self, model: str, version: str = "", fresh: bool = False) -> dict[str, Any]:
        """The config Triton serves ``model`` with (read once per client unless ``fresh``, as after a reload)."""
        if fresh or version:
            return self._call(f"model {model}", self.client.get_model_config, model, str(version), as_json=True)[
                "config"
            ]
        if model not in self._configs:
            self._configs[model] = self._call(f"model {model}", self.client.get_model_config, model, as_json=True)[
                "config"
            ]
        return self._configs[model]

    def wire_names(self, model: str) -> dict[str, str]:
        """{manifest name: served name} for a model whose served config renames its tensors (the container's
        torch_aoti models: ARGS[0], RESULT); empty where they are the same."""
        from .model_config import manifest_names

        return {m: w for w, m in manifest_names(self.config(model)).items()}

    def to_wire(self, model: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``feeds`` by the names the served model takes."""
        wire = self.wire_names(model)
        return {wire.get(k, k): v for k, v in feeds.items()} if wire else feeds

    def from_wire(self, model: str, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A served model's ``outputs`` by the manifest's names."""
        back = {w: m for m, w in self.wire_names(model).items()}
        return {back.get(k, k): v for k, v in outputs.items()} if back else outputs

    def max_batch(self, model: str) -> int:
        """0 for a model without batching (its dims include the batch of 1)."""
        return int(self.config(model).get("max_batch_size", 0))

    def infer(
        self,
        model: str,
        x: np.ndarray,
        version: str = "",
        top_k: int = 0,
        input_name: str | None = None,
        output: str | None = None,
        stream: "InferStream | None" = None,
    ) -> np.ndarray:
        """Send one batch; returns the output array (or, with top_k, Triton's 'score:index:label' rows).
        The request is one ModelInferRequest built straight from the array and sent on tritonclient's
        generated gRPC stub (no InferInput/InferResult objects and one copy of the payload less): as a
        unary call, or on ``stream`` (from open_stream())."""

        cfg, wire = self.config(model), self.wire_names(model)
        out = wire.get(output, output) if output else cfg["output"][0]["name"]
        name = wire.get(input_name, input_name) if input_name else cfg["input"][0]["name"]
        return decode(self._send(model, request(model, x, name, out, version, top_k), stream), out)

    def infer_all(
        self, model: str, feeds: dict[str, np.ndarray], version: str = "", stream: "InferStream | None" = None
    ) -> dict[str, np.ndarray]:
        """Send one batch of every input by name; returns every output by name (the manifest's names, which
        the served model's may differ from: to_wire)."""
        return self.from_wire(
            model,
            decode_all(self._send(model, request_feeds(model, self.to_wire(model, feeds), version=version), stream)),
        )

    def classify(
        self,
        model: str,
        feeds: dict[str, np.ndarray],
        top_k: int,
        version: str = "",
        stream: "InferStream | None" = None,
    ) -> np.ndarray:
        """The top_k classes of the model's first output per row, as Triton's classification extension
        gives them ('score:index:label' strings)."""
        out = self.config(model)["output"][0]["name"]
        return decode(
            self._send(model, request_feeds(model, self.to_wire(model, feeds), out, version, top_k), stream), out
        )

    def _send(self, model: str, req, stream: "InferStream | None" = None):
        """One ModelInferRequest, unary or on ``stream``; its ModelInferResponse, or the refusal as an error."""
        import grpc

        try:
            return (stream or self._model_infer)(req, timeout=self.timeout_s)
        except grpc.RpcError as e:
            msg = (e.details() or str(e.code())).strip()
            raise self._refused(f"model {model}", e.code() == grpc.StatusCode.UNAVAILABLE, msg) from None
        except ClientError as e:  # refused on the stream, which stays open
            raise self._refused(f"model {model}", False, str(e)) from None

    def open_stream(self, requests: int = 1) -> "InferStream":
        """One bidirectional gRPC stream for infer(..., stream=); close() it when done. It ends with an
        error if its ``requests`` take longer than the client's timeout each (a stream has one deadline)."""
        return InferStream(self._channel, deadline_s=self.timeout_s * max(1, requests))

    def _refused(self, what: str, unreachable: bool, msg: str) -> Exception:
        """ServerError when the server cannot be reached, else ClientError carrying the server's message."""
        if unreachable:
            return ServerError(f"cannot reach Triton at {self.url} ({msg}); is the server running?")
        name = what.split()[-1]
        return ClientError(msg if msg.startswith(name + ":") else f"{what}: {msg}")

    def infer_batches(self, model: str, feeds: dict[str, np.ndarray], version: str = "") -> dict[str, np.ndarray]:
        """Run any number of rows of every input, one request per chunk that fits the model's batching (one
        row at a time for a model without batching, whose dims carry the leading 1); every output by name."""
        from torchship.runtime import in_chunks

        back = {w: m for m, w in self.wire_names(model).items()}
        names, outs = list(feeds), [back.get(o["name"], o["name"]) for o in self.config(model)["output"]]

        def run(xs):
            got = self.infer_all(model, dict(zip(names, xs)), version)
            return [got[o] for o in outs]

        return dict(zip(outs, in_chunks(run, [feeds[n] for n in names], self.max_batch(model) or 1)))

    def statistics(self, model: str = "") -> dict[str, Any]:
        return self._call("statistics", self.client.get_inference_statistics, model, as_json=True)

    def close(self) -> None:
        self._channel.close()
        self.client.close()

    def __enter__(self) -> "TritonClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def speaks_tls(url: str, timeout_s: float = 2.0) -> bool:
    """Whether the server at ``url`` completes a TLS handshake (its certificate unchecked: this only tells a
    TLS endpoint from one that is not)."""
    host, _, port = url.rpartition(":")
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as sock:
            with ctx.wrap_socket(sock):
                return True
    except (OSError, ValueError):
        return False


MAX_MESSAGE = 2**31 - 1  # what tritonclient's own channel allows; the server enforces its limit
# After a refused connection gRPC waits a second before it tries again by default, so a client that reaches a
# starting server a moment too early would wait that second; here the first retry comes after 0.1 s. (The
# minimum backoff stays: gRPC also takes it as the time a connection may take to answer.)
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.initial_reconnect_backoff_ms", 100),
]


def infer_channel(url: str, access: Access | None = None):
    """(channel, ModelInfer) on tritonclient's generated gRPC stub, with tritonclient's message limits; a TLS
    channel where ``access`` has TLS files."""
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    creds = access.credentials() if access is not None else None
    channel = (
        grpc.secure_channel(url, creds, options=CHANNEL_OPTIONS)
        if creds
        else grpc.insecure_channel(url, options=CHANNEL_OPTIONS)
    )
    return channel, service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer


class InferStream:
    """Requests one at a time over one bidirectional ModelStreamInfer call on ``channel``, used like the
    unary stub: ``stream(req)`` sends a ModelInferRequest and returns its ModelInferResponse. After the
    first request a round trip is one message each way on a call that is already open, without the
    set-up and tear-down of a unary call. One request in flight at a time. A refused request raises ClientError with the
    server's message, and the stream stays open. ``deadline_s`` bounds the whole stream; the per-call
    ``timeout`` is accepted for the unary stub's signature only."""

    def __init__(self, channel, deadline_s: float = 3600.0):

        from tritonclient.grpc import service_pb2_grpc

        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        self._responses = stub.ModelStreamInfer(iter(self._requests.get, None), timeout=deadline_s)

    def __call__(self, req, timeout: float | None = None):
        self._requests.put(req)
        r = next(self._responses)
        if r.error_message:
            raise ClientError(r.error_message)
        return r.infer_response

    def close(self) -> None:
        self._requests.put(None)  # ends the request side; the server then ends the call
        self._responses.cancel()


def request(model: str, x: np.ndarray, input_name: str, output: str | None = None, version: str = "", top_k: int = 0):
    """A ModelInferRequest carrying ``x`` as raw bytes (one copy), asking for ``output`` (default: all);
    with ``top_k``, as Triton's classification extension ('score:index:label' strings)."""
    return request_feeds(model, {input_name: x}, output, version, top_k)


def request_feeds(
    model: str, feeds: dict[str, np.ndarray], output: str | None = None, version: str = "", top_k: int = 0
):
    """A ModelInferRequest carrying every array of ``feeds`` under its input name."""
    from tritonclient.grpc import service_pb2
    from tritonclient.utils import np_to_triton_dtype

    req = service_pb2.ModelInferRequest(model_name=model, model_version=str(version))
    for name, x in feeds.items():
        dtype = np_to_triton_dtype(x.dtype)
        if dtype is None or dtype == "BYTES":
            raise ShapeError(f"input {name}: cannot send a {x.dtype} array")
        t = req.inputs.add(name=name, datatype=dtype)
        t.shape.extend(x.shape)
        req.raw_input_contents.append(np.ascontiguousarray(x).tobytes())
    if output:
        o = req.outputs.add(name=output)
        if top_k:
            o.parameters["classification"].int64_param = top_k
    return req


def decode_all(response) -> dict[str, np.ndarray]:
    """Every output of a ModelInferResponse by name."""
    return {t.name: decode(response, t.name) for t in response.outputs}


def decode(response, output: str) -> np.ndarray:
    """The named output of a ModelInferResponse as a numpy array (a view on the response's bytes)."""
    from tritonclient.utils import deserialize_bytes_tensor, triton_to_np_dtype

    for i, t in enumerate(response.outputs):
        if t.name == output:
            raw = response.raw_output_contents[i]
            if t.datatype == "BYTES":  # classification results
                return deserialize_bytes_tensor(raw).reshape(t.shape)
            return np.frombuffer(raw, dtype=triton_to_np_dtype(t.datatype)).reshape(t.shape)
    raise ClientError(f"the response has no output {output!r}")
