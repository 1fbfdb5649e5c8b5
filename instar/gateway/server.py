"""The loopback gateway: OpenAI and Anthropic endpoints in front of the engine.

    agent (stock SDK) ──HTTP 127.0.0.1──> /s/<session>/v1/chat/completions   (OpenAI)
                                          /s/<session>/v1/responses          (OpenAI Responses)
                                          /s/<session>/v1/messages           (Anthropic)
                                          /s/<session>/v1/models             (GET, both)
                                                 │ wire.parse -> chat messages
                                                 ▼
                                 Session.plan: extend the recorded tokens or start a segment
                                                 ▼
                                 engine generate(token ids) -> ids, log-probs, versions
                                   (stream: the reply's text sent on as it settles)
                                                 ▼
                                 Session.record; wire.response / wire.stream (the rest)

Bound to 127.0.0.1, a random API key per run (checked on every request), one unguessable
session id per episode. Bad input is answered in the wire's own error shape (4xx) and
leaves the session's recorded tokens unchanged; nothing a client sends gets a 5xx. Work per
request is bounded (a body limit, a length bound before tokenising, image limits checked
before decoding) and done off the event loop (JSON, images, template, tokeniser), so one
request cannot stall the other sessions. A client that hangs up cancels its engine request.

A streamed request (given `stream`) gets its reply's text as the engine generates it, as far
as the text is settled (`Parsers.settled`); reasoning and tool calls, and the rest of the text,
follow at the end from the finished generation, which is what the session records, as for a
request not streamed. Refusals before any text settles are answered as such (4xx); a failure
after it ends the stream with the wire's error event.
"""

import asyncio
import json
import logging
import secrets
import socket
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from instar.agents.images import IMAGE_TOKEN
from instar.errors import EpisodeError, Requeue
from instar.gateway.responses import ResponsesWire, response_id
from instar.gateway.session import Session
from instar.gateway.wire import (
    AnthropicWire,
    OpenAIWire,
    Reply,
    WireError,
    bad_request,
    make_reply,
    whole,
)

log = logging.getLogger(__name__)
RESTARTED = "a weight update stopped this episode; instar restarts it from the beginning"


class Gateway:
    """Runs the HTTP server in a background thread; sessions are opened and closed by the
    rollout code in the caller's thread. `generate(episode, ids, sampling, images)` calls the
    engine (the episode key lets a router keep a session on one engine). `stream`: the same
    with a fifth argument, `on_text`, called (from any thread) with each piece of the reply's
    text as it settles, as `Router.generate` does; without it, a streamed reply is sent whole
    once it is generated."""

    def __init__(self, generate, tokenizer, *, model: str, max_model_len: int,
                 max_body_mb: float = 32, stream=None):
        self.generate, self.stream, self.tokenizer = generate, stream, tokenizer
        self.model, self.max_model_len = model, max_model_len
        self.max_body_bytes = int(max_body_mb * (1 << 20))
        self.vision = IMAGE_TOKEN in tokenizer.get_vocab()  # the model takes images
        self.token_chars = max(map(len, tokenizer.get_vocab()))
        """The most characters a token's text can hold: bounds the tokens of a text cheaply."""
        self.api_key = "sk-instar-" + secrets.token_urlsafe(24)
        self.sessions: dict[str, Session] = {}
        self.locks: dict[str, asyncio.Lock] = {}
        self.app = FastAPI(title="instar gateway", docs_url=None, redoc_url=None,
                           openapi_url=None)  # (they would answer without the key)
        self.app.post("/s/{sid}/v1/chat/completions")(self._route(OpenAIWire))
        self.app.post("/s/{sid}/v1/responses")(self._route(ResponsesWire))
        self.app.post("/s/{sid}/v1/messages")(self._route(AnthropicWire))
        self.app.get("/s/{sid}/v1/models")(self._models)
        self.app.exception_handler(StarletteHTTPException)(self._http_error)
        self.server: uvicorn.Server | None = None

    @staticmethod
    async def _http_error(request: Request, exc: StarletteHTTPException):
        wire = AnthropicWire if request.url.path.endswith("/messages") else OpenAIWire
        e = WireError(exc.status_code, "not_found_error" if exc.status_code == 404
                      else "invalid_request_error", str(exc.detail))
        return JSONResponse(wire.error(e), status_code=exc.status_code)

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> "Gateway":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.base = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the gateway failed to start")
            threading.Event().wait(0.02)
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            self.thread.join(timeout=10)

    def open_session(self, rollout_id: str, group_id: str, sampling: dict[str, Any],
                     max_turns: int, max_tokens: int) -> str:
        """A new episode; `sampling` (temperature, max_tokens) applies to all its requests."""
        sid = secrets.token_urlsafe(16)
        self.sessions[sid] = Session(self.tokenizer, rollout_id, group_id, sampling,
                                     max_turns, max_tokens)
        return sid

    def close_session(self, sid: str) -> Session:
        self.locks.pop(sid, None)
        return self.sessions.pop(sid)

    def urls(self, sid: str) -> tuple[str, str]:
        """(OpenAI base URL ending in /v1, Anthropic base URL)."""
        return f"{self.base}/s/{sid}/v1", f"{self.base}/s/{sid}"

    # -- requests ------------------------------------------------------------------------
    def _route(self, wire):
        async def handle(sid: str, request: Request):
            try:
                return await self._handle(wire, sid, request)
            except WireError as e:
                return JSONResponse(wire.error(e), status_code=e.status)
            except Exception as e:
                return JSONResponse(wire.error(_internal(e)), status_code=500)
        handle.__name__ = f"{wire.name}_endpoint"
        return handle

    def _check_key(self, request: Request) -> None:
        auth = request.headers.get("authorization", "")
        given = request.headers.get("x-api-key") or auth.removeprefix("Bearer ").strip()
        if not secrets.compare_digest(given.encode(), self.api_key.encode()):
            raise WireError(401, "authentication_error", "invalid API key", "invalid_api_key")

    async def _body(self, request: Request) -> bytes:
        """The body, refused (413) past `max_body_bytes` before more of it is read."""
        too_large = WireError(413, "invalid_request_error", f"the request body is over "
                              f"{self.max_body_bytes} bytes", "request_too_large")
        size = request.headers.get("content-length", "0")
        if not size.isdigit() or int(size) > self.max_body_bytes:
            raise too_large
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise too_large
        return bytes(body)

    def _parse(self, wire, raw: bytes, room: int):
        """Body -> request (run in a worker thread: decoding JSON and images takes time)."""
        try:
            body = json.loads(raw)
        except RecursionError as e:
            raise bad_request("malformed JSON body: nested too deeply") from e
        except ValueError as e:  # (JSON, UTF-8, or an integer with too many digits)
            raise bad_request(f"malformed JSON body: {e}") from e
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        try:
            req = wire.parse(body, self.vision)
            chars = _text_chars([req.messages, req.tools, req.instructions])
        except WireError:
            raise
        except Exception as e:  # a field of an unexpected type
            raise bad_request(f"invalid request: {type(e).__name__}: {e}"[:300]) from e
        if chars > room * self.token_chars:  # cheap: a token holds at most token_chars chars
            raise bad_request(f"the messages ({chars} characters) cannot fit in {room} tokens",
                              "context_length_exceeded")
        return req

    @staticmethod
    def _check_sampling(req, sampling: dict[str, Any]) -> None:
        """A request may not sample differently from what the trainer will assume."""
        run = {"temperature": sampling["temperature"], "top_p": 1.0, "top_k": 0.0}
        for name, value in req.sampling.items():
            if value != run[name]:
                fix = ("or change the run's --rollout.temperature" if name == "temperature"
                       else "(instar samples from the full distribution)")
                raise bad_request(
                    f"{name}={value} differs from the run's {name}={run[name]}: the trainer "
                    f"recomputes log-probs with the run's sampling; leave {name} unset {fix}",
                    "unsupported_value")

    async def _generate(self, request: Request, session: Session, turn, params: dict,
                        live: "Live | None"):
        """The engine's generation (its text to `live` as it settles); None if the client
        disconnected first (the engine request is then cancelled: nothing of it is recorded)."""
        async def gone():
            while (await request.receive())["type"] != "http.disconnect":
                pass
        args = session.rollout_id, turn.prompt_ids, params, turn.images
        gen, watch = (asyncio.ensure_future(c) for c in (
            self.generate(*args) if live is None else self.stream(*args, live.put), gone()))
        await asyncio.wait({gen, watch}, return_when=asyncio.FIRST_COMPLETED)
        watch.cancel()
        if not gen.done():
            gen.cancel()
            log.info("a client disconnected: its request to the engine was cancelled")
            return None
        try:
            return gen.result()
        except Requeue as e:
            session.requeued = True
            raise bad_request(RESTARTED, "episode_restarted") from e
        except EpisodeError as e:  # not the agent's doing: the rollout fails as such
            session.failed = e
            raise bad_request(f"this episode failed: {e}", "episode_failed") from e
        except ValueError as e:  # the engine refused a value (a RayTaskError is its cause too)
            reason = str(getattr(e, "cause", e)).strip().splitlines()[-1:] or [""]
            raise bad_request(f"the engine refused this request: {reason[0][:200]}") from e
        except Exception as e:  # an infrastructure failure: it stops the run, as on the Env path
            log.warning("engine call failed", exc_info=e)  # (its text may hold paths, pids)
            session.failed = RuntimeError(f"the engine failed in episode {session.rollout_id}")
            session.failed.__cause__ = e
            raise WireError(503, "api_error", f"the engine failed ({type(e).__name__}); this "
                            "episode stops") from e

    async def _handle(self, wire, sid: str, request: Request):
        self._check_key(request)
        session = self.sessions.get(sid)
        if session is None:
            raise WireError(404, "not_found_error", "unknown session", "session_not_found")
        if session.requeued:
            raise bad_request(RESTARTED, "episode_restarted")
        if session.failed is not None:
            raise bad_request(f"this episode failed: {session.failed}", "episode_failed")
        room = min(self.max_model_len, session.max_tokens)
        req = await asyncio.to_thread(self._parse, wire, await self._body(request), room)
        self._check_sampling(req, session.sampling)
        if not (req.stream and self.stream):
            return (await self._turn(wire, sid, session, req, request))[1]
        live = Live()  # the turn goes on, holding the session, while its reply is sent
        live.turn = asyncio.ensure_future(self._turn(wire, sid, session, req, request, live))
        live.turn.add_done_callback(live.end)
        first = await live.items.get()
        if isinstance(first, Exception):  # refused before any text came
            raise first
        if isinstance(first, Reply):  # no text settled before the end: sent whole
            return self._render(wire, first, req)
        return StreamingResponse(wire.stream(live.start, live.after(first), self.model, req),
                                 media_type="text/event-stream")

    async def _turn(self, wire, sid: str, session: Session, req, request: Request,
                    live: "Live | None" = None):
        """Plan, generate and record one request, holding its session: (the reply, its whole
        response, rendered before the reply is recorded: all or nothing). `live`: where the
        reply's text goes as it settles."""
        async with self.locks.setdefault(sid, asyncio.Lock()):
            if req.previous is not None:  # (Responses) a stored conversation, continued
                if req.previous not in session.responses:
                    raise bad_request(f"no stored response {req.previous!r:.60} in this episode",
                                      "previous_response_not_found")
                req.messages = session.responses[req.previous] + req.messages
            conversation = req.messages
            if req.instructions:
                req.messages = [{"role": "system", "content": req.instructions}, *req.messages]
            options = [req.max_tokens, req.stop, req.parse_tools, req.seed, req.logprobs]
            try:  # (rendering and tokenising, off the event loop)
                turn = await asyncio.to_thread(session.plan, req.messages, req.tools, options)
            except Exception as e:  # the template could not render these messages
                raise bad_request(f"cannot render these messages: {e}"[:300]) from e
            if session.is_retry(turn):
                return session.last_reply, self._render(wire, session.last_reply, req)
            if limit := session.over_limit(turn):
                session.truncated = limit
                raise bad_request(f"this episode reached its {limit} limit", "episode_limit")
            room = min(self.max_model_len, session.max_tokens)
            if len(turn.prompt_ids) >= room:
                raise bad_request(
                    f"the context ({len(turn.prompt_ids)} tokens) leaves no room to generate "
                    f"within the model's {self.max_model_len} tokens", "context_length_exceeded")
            params = {**session.sampling,
                      "max_tokens": min(req.max_tokens or session.sampling["max_tokens"],
                                        room - len(turn.prompt_ids)),
                      **({"stop": req.stop} if req.stop else {}),
                      **({"seed": req.seed} if req.seed is not None else {})}
            if live is not None:
                live.start = Reply("", [], "", None, len(turn.prompt_ids), 0)
            session.generating_since = time.monotonic()
            try:
                gen = await self._generate(request, session, turn, params, live)
            finally:
                session.generating_since = None
            if gen is None:
                raise bad_request("the client disconnected")
            reply = make_reply(gen, req, len(turn.prompt_ids), self.tokenizer)
            if live is not None:
                reply.id = live.start.id
            body = self._render(wire, reply, req)  # before recording: all or nothing
            session.record(turn, req.messages, req.tools, gen, reply.message, reply)
            if req.store:
                session.responses[response_id(reply)] = [*conversation, reply.message]
            return reply, body

    def _render(self, wire, reply, req):
        if req.stream:
            return StreamingResponse(wire.stream(reply, whole(reply), self.model, req),
                                     media_type="text/event-stream")
        return JSONResponse(wire.response(reply, self.model, req))

    async def _models(self, sid: str, request: Request):
        """The one model this gateway serves, as OpenAI lists models (Anthropic's list when
        the request carries the anthropic-version header its SDK sends)."""
        anthropic = "anthropic-version" in request.headers
        wire = AnthropicWire if anthropic else OpenAIWire
        try:
            self._check_key(request)
            if sid not in self.sessions:
                raise WireError(404, "not_found_error", "unknown session", "session_not_found")
        except WireError as e:
            return JSONResponse(wire.error(e), status_code=e.status)
        if anthropic:
            return JSONResponse({"data": [{"type": "model", "id": self.model, "display_name":
                                           self.model, "created_at": "1970-01-01T00:00:00Z"}],
                                 "has_more": False, "first_id": self.model,
                                 "last_id": self.model})
        return JSONResponse({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "instar"}]})


class Live:
    """A reply streamed as it is generated: its turn (a task, which holds the session until it
    has recorded the reply) puts pieces of the reply's text here as they settle, then the
    Reply, or the exception that ended the turn."""

    def __init__(self):
        self.loop, self.items = asyncio.get_running_loop(), asyncio.Queue()
        self.turn: asyncio.Task | None = None  # (the loop holds tasks weakly)
        self.start: Reply | None = None
        """What is known of the reply before it is generated: its id and prompt size."""

    def put(self, item) -> None:  # (from any thread: the router may run on another loop)
        self.loop.call_soon_threadsafe(self.items.put_nowait, item)

    def end(self, turn: asyncio.Task) -> None:
        if not turn.cancelled():
            self.put(turn.exception() or turn.result()[0])

    async def after(self, first: str):
        """`first`, the pieces after it, then the reply or the WireError that ended it."""
        item = first
        while isinstance(item, str):
            yield item
            item = await self.items.get()
        yield item if not isinstance(item, Exception) or isinstance(item, WireError) \
            else _internal(item)


def _internal(e: Exception) -> WireError:
    """A bug, logged; the client learns nothing of the internals."""
    log.exception("the gateway failed on a request", exc_info=e)
    return WireError(500, "api_error", "internal error")


def _text_chars(x) -> int:
    """Characters of text in parsed messages and tools (images not counted)."""
    if isinstance(x, str):
        return len(x)
    if isinstance(x, dict):
        return sum(_text_chars(v) for k, v in x.items() if k != "image")
    return sum(map(_text_chars, x)) if isinstance(x, list) else 0
