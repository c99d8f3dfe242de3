"""One handler per endpoint, each reading the `AppState` from `request.app.state.k3`.

The two generating endpoints differ only in how a choice turns engine outputs into OpenAI pieces: a chat
choice parses the reply (`k3.chat.template.ReplyStream`: reasoning, content, tool calls; stop strings on the
content), a completion choice shows the text (`k3.chat.detokenize.TextStream`; stop strings on the text,
special tokens left out). Both answer through `k3.serve.stream.respond`.
"""

from __future__ import annotations

import codecs
import math
import re
import time
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import PlainTextResponse

from k3.chat.constrain import forced_tools, reply_grammar
from k3.chat.detokenize import TextStream, TokenText
from k3.chat.template import (
    ReplyAccumulator,
    ReplyStream,
    TemplateError,
    content_text,
    normalize_effort,
)
from k3.infer.api import MediaInput, MediaPrompt, RequestOutput, TokenLogprob
from k3.infer.grammar import GrammarError
from k3.infer.metrics import render_prometheus
from k3.serve import protocol as P
from k3.serve.errors import bad_request
from k3.serve.state import AppState
from k3.serve.stream import Choice, Run, respond
from k3.serve.validate import (
    authorize,
    check_admissible,
    check_chat,
    check_completion,
    check_model,
    check_prompt_fits,
    check_schemas,
    completion_budget,
    completion_prompts,
    parse_body,
    read_raw,
    sampling_params,
)


def _state(request: Request) -> AppState:
    return request.app.state.k3


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


def _usage(choices: Sequence[Choice], prompt_tokens: int, cached: int, reasoning: int = 0) -> P.Usage:
    completion = sum(c.completion_tokens for c in choices)
    return P.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion,
                   total_tokens=prompt_tokens + completion,
                   prompt_tokens_details=P.PromptTokensDetails(cached_tokens=cached),
                   completion_tokens_details=P.CompletionTokensDetails(
                       reasoning_tokens=reasoning,
                       accepted_prediction_tokens=sum(c.accepted_prediction_tokens for c in choices),
                       rejected_prediction_tokens=sum(c.rejected_prediction_tokens for c in choices)))


def _header(state: AppState, response_id: str) -> dict:
    """The fields every body and chunk of one response repeats."""
    return {"id": response_id, "created": int(time.time()), "model": state.model_name,
            "system_fingerprint": state.fingerprint}


class ChatChoice(Choice):
    """A chat choice: the parsed reply (tool calls filtered by the request's tool options) and chat logprobs."""

    def __init__(self, index: int, run: Run, reply: ReplyStream, thinking: bool, tools: bool,
                 parallel_tool_calls: bool, logprobs: bool, token_text: TokenText):
        super().__init__(index, run)
        self.reply = reply
        self.thinking = thinking
        self.tools = tools
        self.parallel = parallel_tool_calls
        self.logprobs = logprobs
        self.token_text = token_text
        self.num_calls = 0
        self.acc = ReplyAccumulator()
        self.lps: list[P.ChatLogprob] = []

    def update(self, out: RequestOutput) -> P.ChatChunkChoice | None:
        self.account(out)
        delta = self.reply.feed(out.new_token_ids, out.finished)
        if self.reply.stopped:
            self.finish("stop")
        else:
            # calls are dropped when no tools were offered (or tool_choice is none), all but the first when not
            # parallel
            delta.tool_calls = [c for c in delta.tool_calls if self.tools and (self.parallel or c.index == 0)]
            self.num_calls = max([self.num_calls] + [c.index + 1 for c in delta.tool_calls])
            if out.finished:
                self.finish("length" if out.finish_reason == "length" else ("tool_calls" if self.num_calls else "stop"))
        self.acc.add(delta)
        lp = self._logprobs(out.logprobs) if self.logprobs else []
        self.lps += lp
        if not (delta or lp):
            return None
        calls = [P.ToolCallDeltaOut(index=t.index, id=t.id, type="function" if t.id else None,
                                    function=P.FunctionCallDelta(name=t.name, arguments=t.arguments))
                 for t in delta.tool_calls]
        d = P.ChatDelta(content=delta.content or None, reasoning_content=delta.reasoning or None,
                        tool_calls=calls or None)
        return P.ChatChunkChoice(index=self.index, delta=d, logprobs=P.ChoiceLogprobs(content=lp) if lp else None)

    def _logprobs(self, entries: list[TokenLogprob] | None) -> list[P.ChatLogprob]:
        out = []
        for e in entries or []:
            text, raw = self.token_text(e.token_id)
            top = []
            for tid, lp in e.top:
                ttext, traw = self.token_text(tid)
                top.append(P.ChatLogprobTop(token=ttext, logprob=_finite(lp), bytes=traw))
            out.append(P.ChatLogprob(token=text, logprob=_finite(e.logprob), bytes=raw, top_logprobs=top))
        return out

    def finish_piece(self) -> P.ChatChunkChoice:
        return P.ChatChunkChoice(index=self.index, delta=P.ChatDelta(), finish_reason=self.finish_reason)

    def result(self) -> P.ChatChoice:
        reply = self.acc.reply(self.thinking)
        calls = [P.ToolCallOut(id=t.id, function=P.FunctionCallOut(name=t.name, arguments=t.arguments))
                 for t in reply.tool_calls]
        message = P.AssistantMessage(content=reply.content, reasoning_content=reply.reasoning_content,
                                     tool_calls=calls or None)
        return P.ChatChoice(index=self.index, message=message, finish_reason=self.finish_reason or "stop",
                            logprobs=P.ChoiceLogprobs(content=self.lps) if self.logprobs else None)


class TextChoice(Choice):
    """A completion choice: the visible text and the legacy logprobs (tokens, offsets, top alternatives).

    With echo the prompt comes first: its text (`echo`, never matched against stop strings, which apply to the
    generated text as in OpenAI's API) and, with logprobs, its scores (`echo_scores`, a
    `k3.infer.score.PromptScores`). Tokens are shown as OpenAI shows them: their text, specials by name, and a
    piece of a multi-byte character as `bytes:\\xNN` (so no two alternatives share a key). `text_offset` counts
    characters of the returned text: a token starts where the characters decoded before it end; special tokens,
    which the text leaves out, advance it by nothing."""

    def __init__(self, index: int, run: Run, text: TextStream, logprobs: int | None, token_text: TokenText,
                 echo: str = "", echo_scores: Any = None):
        super().__init__(index, run)
        self.stream = text
        self.logprobs = logprobs
        self.token_text = token_text
        self.echo = echo
        self.text = ""
        self.offset = 0  # text_offset of the next token
        self.chars = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # the prompt's tokens index the echoed text from 0; the generated ones continue after the whole of it
        self.echo_lps = self._logprobs(echo_scores.token_logprobs(), echo_scores.ids) if echo_scores else None
        self.offset = len(echo)
        self.chars.reset()
        self.lps = P.CompletionLogprobs(top_logprobs=[] if logprobs else None)

    def opening(self) -> P.CompletionChoice | None:
        """The echoed prompt (text and logprobs), streamed before the first generated piece."""
        if not self.echo and self.echo_lps is None:
            return None
        return P.CompletionChoice(index=self.index, text=self.echo, logprobs=self.echo_lps)

    def update(self, out: RequestOutput) -> P.CompletionChoice | None:
        self.account(out)
        text = self.stream.feed(out.new_token_ids, out.finished)
        if self.stream.stopped:
            self.finish("stop")
        elif out.finished:
            self.finish("length" if out.finish_reason == "length" else "stop")
        self.text += text
        lp = None
        if self.logprobs is not None:
            lp = self._logprobs(out.logprobs or [], [e.token_id for e in out.logprobs or []])
            _extend(self.lps, lp)
        if not text and lp is None:
            return None
        return P.CompletionChoice(index=self.index, text=text, logprobs=lp)

    def _logprobs(self, entries: list[TokenLogprob | None], token_ids: list[int]) -> P.CompletionLogprobs:
        """Entries of consecutive tokens (None: a prompt's first token) -> legacy logprobs, offsets from here on."""
        lp = P.CompletionLogprobs(top_logprobs=[] if self.logprobs else None)
        for token_id, e in zip(token_ids, entries):
            lp.tokens.append(self._token(token_id))
            lp.token_logprobs.append(None if e is None else _finite(e.logprob))
            lp.text_offset.append(self.offset)
            if not self.token_text.tokenizer.is_special(token_id):
                self.offset += len(self.chars.decode(bytes(self.token_text(token_id)[1])))
            if self.logprobs:
                lp.top_logprobs.append(None if e is None else {self._token(t): _finite(v) for t, v in e.top})
        return lp

    def _token(self, token_id: int) -> str:
        text, raw = self.token_text(token_id)
        if self.token_text.tokenizer.is_special(token_id):
            return text
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def finish_piece(self) -> P.CompletionChoice:
        return P.CompletionChoice(index=self.index, text="", finish_reason=self.finish_reason)

    def result(self) -> P.CompletionChoice:
        lps = None
        if self.logprobs is not None:
            lps = P.CompletionLogprobs(top_logprobs=[] if self.logprobs else None)
            if self.echo_lps is not None:
                _extend(lps, self.echo_lps)
            _extend(lps, self.lps)
        return P.CompletionChoice(index=self.index, text=self.echo + self.text,
                                  finish_reason=self.finish_reason or "stop", logprobs=lps)


def _extend(total: P.CompletionLogprobs, more: P.CompletionLogprobs) -> None:
    total.tokens += more.tokens
    total.token_logprobs += more.token_logprobs
    total.text_offset += more.text_offset
    if more.top_logprobs is not None and total.top_logprobs is not None:
        total.top_logprobs += more.top_logprobs


def prepare_chat(state: AppState, raw: bytes) -> tuple[P.ChatCompletionRequest, list[int], bool, list]:
    """A chat request's body → (request, prompt ids, thinking, SamplingParams per choice): parsing, checks,
    rendering, tokenizing and the reply's grammar. Runs in the worker pool (`AppState.offload`)."""
    req, body = parse_body(raw, P.ChatCompletionRequest)
    return prepare_chat_request(state, req, body)


def prepare_chat_request(state: AppState, req: P.ChatCompletionRequest, body: dict[str, Any]
                         ) -> tuple[P.ChatCompletionRequest, list[int], bool, list]:
    """`prepare_chat` after parsing (the Responses endpoint comes here with the chat request it maps to)."""
    check_model(state, req.model)
    check_chat(req)
    check_schemas(body)
    tools, tool_choice, response_format = body.get("tools"), body.get("tool_choice"), body.get("response_format")
    try:
        thinking = normalize_effort(req.reasoning_effort, state.medium_effort) is not None
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        images = image_parts(messages)
        if images and getattr(state, "images", None) is None:
            raise bad_request(f"{state.model_name} is a text-only model: it takes no image_url content parts",
                              images[0])
        # no token is longer than `max_token_bytes`: text over context × that cannot fit, whatever it tokenizes to
        size = sum(len(content_text(text_parts(m.get("content")), f"messages[{i}].content").encode())
                   for i, m in enumerate(messages))
        if size > state.max_context * state.max_token_bytes:
            raise bad_request(f"this model's context is {state.max_context} tokens, and the messages hold {size} "
                              f"bytes of text: more than that whatever they tokenize to (a token holds at most "
                              f"{state.max_token_bytes} bytes)", "messages", "context_length_exceeded")
        options = {"tools": tools, "reasoning_effort": req.reasoning_effort, "tool_choice": tool_choice,
                   "response_format": response_format}
        prompt = render_images(state, messages, options) if images else state.template.render(messages, **options)
    except TemplateError as e:
        raise bad_request(str(e), e.param) from None
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = completion_budget(state, len(prompt), requested, param, "messages")
    check_admissible(state, [len(prompt) + max_tokens] * req.n)
    grammar = None
    lark = reply_grammar(state.template, thinking=thinking, tools=tools, tool_choice=tool_choice,
                         parallel_tool_calls=req.parallel_tool_calls, response_format=response_format)
    if lark is not None:
        try:
            grammar = state.grammars.compile(lark)
        except GrammarError as e:
            param = "tools" if forced_tools(tools, tool_choice) else "response_format"
            raise bad_request(f"the schema cannot be used for constrained decoding: {e}", param) from None
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = [sampling_params(state, req, max_tokens, i, logprobs, grammar) for i in range(req.n)]
    return req, prompt, thinking, params


def image_parts(messages: list[dict[str, Any]]) -> list[str]:
    """The params (`messages[i].content[j]`) of the `image_url` parts of a chat."""
    return [f"messages[{i}].content[{j}]" for i, m in enumerate(messages) if isinstance(m.get("content"), list)
            for j, part in enumerate(m["content"]) if isinstance(part, dict) and part.get("type") == "image_url"]


def text_parts(content: Any) -> Any:
    """Message content without its image parts (what the text-size check measures)."""
    if not isinstance(content, list):
        return content
    return [part for part in content if not (isinstance(part, dict) and part.get("type") == "image_url")]


def render_images(state: AppState, messages: list[dict[str, Any]], options: dict[str, Any]) -> MediaPrompt:
    """A chat with images → its prompt ids (each image's pads expanded) carrying the images for the engine; a bad
    image part is a 400 naming it (`k3.vision.chat`: data URLs always, local files only when allowed, never a
    network fetch)."""
    from k3.vision.chat import ImageError, render_with_media

    try:
        ids, items = render_with_media(state.template, messages, state.images, **options)
    except ImageError as e:
        raise bad_request(str(e), e.param) from None
    return MediaPrompt(ids, [MediaInput(it.pixel_values, it.grid_thw, it.num_tokens()) for it in items])


async def chat_completions(request: Request):
    state = _state(request)
    authorize(state, request)
    raw = await read_raw(request, state.max_request_bytes)
    req, prompt, thinking, params = await state.offload(prepare_chat, state, raw)
    response_id = "chatcmpl-" + uuid.uuid4().hex
    run = Run(state.engine, [(f"{response_id}-{i}", prompt, params[i]) for i in range(req.n)])
    tools_on = bool(req.tools) and req.tool_choice != "none"
    choices = [ChatChoice(i, run, ReplyStream(state.tokenizer, thinking, req.stop_list()), thinking, tools_on,
                          req.parallel_tool_calls, req.logprobs, state.token_text) for i in range(req.n)]

    def usage() -> P.Usage:
        return _usage(choices, len(prompt), choices[0].cached_tokens,
                      sum(c.reply.parser.reasoning_tokens for c in choices))

    opening = [P.ChatChunkChoice(index=c.index, delta=P.ChatDelta(role="assistant", content="")) for c in choices]
    return await respond(request, state, req, run, choices, header=_header(state, response_id),
                         response_model=P.ChatCompletion, chunk_model=P.ChatCompletionChunk, usage=usage,
                         opening=opening)


def prepare_completion(state: AppState, raw: bytes) -> tuple[P.CompletionRequest, list, list, list[int]]:
    """A completion request's body → (request, token ids per prompt, text per prompt, max_tokens per prompt);
    runs in the worker pool."""
    req, _ = parse_body(raw, P.CompletionRequest)
    check_model(state, req.model)
    check_completion(state, req)
    ids_list, texts = completion_prompts(state, req)
    if req.max_tokens == 0:  # echo only: the prompts are scored, nothing is generated
        for i, ids in enumerate(ids_list):
            check_prompt_fits(state, len(ids), "prompt" if len(ids_list) == 1 else f"prompt[{i}]")
        return req, ids_list, texts, [0] * len(ids_list)
    max_tokens = [completion_budget(state, len(ids), req.max_tokens, "max_tokens", "prompt") for ids in ids_list]
    check_admissible(state, [len(ids) + m for ids, m in zip(ids_list, max_tokens) for _ in range(req.n)])
    return req, ids_list, texts, max_tokens


async def completions(request: Request):
    state = _state(request)
    authorize(state, request)
    raw = await read_raw(request, state.max_request_bytes)
    req, ids_list, texts, max_tokens = await state.offload(prepare_completion, state, raw)
    scores = [None] * len(ids_list)
    if req.echo and req.logprobs is not None:
        # the prompt's own logprobs, teacher-forced (OpenAI's echo: null for the first token, which has no context)
        try:
            scores = await state.scorer.ascore(ids_list, req.logprobs)
        except ValueError as e:
            raise bad_request(str(e), "prompt") from None
    response_id = "cmpl-" + uuid.uuid4().hex
    generate = req.max_tokens != 0
    items = []
    if generate:
        for p_index, ids in enumerate(ids_list):
            for j in range(req.n):
                k = p_index * req.n + j
                items.append((f"{response_id}-{k}", ids,
                              sampling_params(state, req, max_tokens[p_index], j, req.logprobs)))
    run = Run(state.engine, items)
    choices = [TextChoice(k, run, TextStream(state.tokenizer, req.stop_list()), req.logprobs, state.token_text,
                          echo=texts[k // req.n] if req.echo else "", echo_scores=scores[k // req.n])
               for k in range(len(ids_list) * req.n)]
    opening = [piece for c in choices if (piece := c.opening()) is not None]
    if not generate:
        for c in choices:
            c.finish_reason = "length"
        opening += [c.finish_piece() for c in choices]
    prompt_tokens = sum(len(ids) for ids in ids_list)

    def usage() -> P.Usage:
        cached = sum(choices[p * req.n].cached_tokens for p in range(len(ids_list)))
        return _usage(choices, prompt_tokens, cached)

    return await respond(request, state, req, run, choices, header=_header(state, response_id),
                         response_model=P.Completion, chunk_model=P.Completion, usage=usage, opening=opening)


def _special_pattern(tokenizer) -> re.Pattern:
    names = sorted(tokenizer.special_tokens, key=len, reverse=True)
    return re.compile("(" + "|".join(re.escape(n) for n in names) + ")")


def tokenize_text(state: AppState, text: str, add_special_tokens: bool) -> list[int]:
    """`/tokenize`'s ids: as vLLM's endpoint does with a Hugging Face tokenizer, a special token's spelling becomes
    its id (so a client can look up `[EOS]`); ordinary text is `Tokenizer.encode`'s, and `add_special_tokens`
    puts `[BOS]` first, as a string prompt of `/v1/completions` gets it. (Prompts of the API never parse specials.)"""
    tokenizer = state.tokenizer
    ids = [tokenizer.bos_id] if add_special_tokens else []
    for n, piece in enumerate(_special_pattern(tokenizer).split(text)):
        if n % 2:
            ids.append(tokenizer.special_tokens[piece])
        elif piece:
            ids += tokenizer.encode(piece)
    return ids


async def tokenize(request: Request):
    state = _state(request)
    authorize(state, request)
    req, _ = parse_body(await read_raw(request, state.max_request_bytes), P.TokenizeRequest)
    check_model(state, req.model)
    ids = await state.offload(tokenize_text, state, req.prompt, req.add_special_tokens)
    return {"count": len(ids), "max_model_len": state.max_context, "tokens": ids}


async def detokenize(request: Request):
    state = _state(request)
    authorize(state, request)
    req, _ = parse_body(await read_raw(request, state.max_request_bytes), P.DetokenizeRequest)
    check_model(state, req.model)
    if any(t >= state.tokenizer.vocab_size for t in req.tokens):
        raise bad_request(f"token ids must be in [0, {state.tokenizer.vocab_size})", "tokens")
    return {"prompt": state.tokenizer.decode(req.tokens)}


async def tokenizer_info(request: Request):
    """What a remote-tokenizer client needs (vLLM's fields): the special tokens' spellings and the context."""
    state = _state(request)
    authorize(state, request)
    tokenizer = state.tokenizer
    names = {i: name for name, i in tokenizer.special_tokens.items()}
    return {"tokenizer_class": "k3.tokenizer.Tokenizer", "vocab_size": tokenizer.vocab_size,
            "bos_token": names[tokenizer.bos_id], "eos_token": names[tokenizer.document_end_id],
            "pad_token": names[tokenizer.pad_id], "model_max_length": state.max_context, "chat_template": None}


async def list_models(request: Request):
    state = _state(request)
    authorize(state, request)
    card = P.ModelCard(id=state.model_name, created=state.created, max_model_len=state.max_context)
    return P.ModelList(data=[card]).dump()


async def get_model(name: str, request: Request):
    state = _state(request)
    authorize(state, request)
    check_model(state, name)
    return P.ModelCard(id=state.model_name, created=state.created, max_model_len=state.max_context).dump()


async def health():
    return {"status": "ok"}


async def metrics(request: Request):
    engine = _state(request).engine
    return PlainTextResponse(render_prometheus(engine.metrics()), media_type="text/plain; version=0.0.4")
