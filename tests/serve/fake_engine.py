"""A test double of `k3.infer.engine.AsyncEngine`: the same `stream` / `abort` / `metrics` interface, one
request at a time through the plain generation loop (`k3.infer.generate.generate_steps`), plus hooks the
real engine does not have: `script` (the next requests write these token ids without running the model:
tool-call replies), `refuse` (the next request raises this `AdmissionError`), `delay` and `fail_after`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import torch

from k3.infer.api import AdmissionError, RequestOutput, SamplingParams
from k3.infer.generate import generate_steps


class FakeEngine:
    def __init__(self, model, vocab_size: int):
        self.model = model
        self.vocab_size = vocab_size
        self.script: list[list[int]] = []
        self.refuse: AdmissionError | None = None
        self.delay = 0.0
        self.fail_after: int | None = None
        self.requests: list[tuple[str, list[int], SamplingParams]] = []
        self.running = 0
        self.waiting = 0
        self.finished = 0
        self.aborted_ids: set[str] = set()
        self._abort: set[str] = set()
        self._lock: asyncio.Lock | None = None

    def abort(self, request_id: str) -> None:
        self._abort.add(request_id)
        self.aborted_ids.add(request_id)

    def metrics(self) -> dict[str, float]:
        return {"requests_running": self.running, "requests_waiting": self.waiting,
                "requests_finished_total": self.finished}

    async def stream(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams
                     ) -> AsyncIterator[RequestOutput]:
        if self.refuse is not None:
            error, self.refuse = self.refuse, None
            raise error
        sampling.validate(self.vocab_size)
        self.requests.append((request_id, list(prompt_ids), sampling))
        script = self.script.pop(0) if self.script else None
        fail_after, self.fail_after = self.fail_after, None
        self._lock = self._lock or asyncio.Lock()
        self.waiting += 1
        waiting = True
        try:
            async with self._lock:
                self.waiting -= 1
                waiting = False
                self.running += 1
                try:
                    await asyncio.sleep(self.delay)
                    async for out in self._generate(request_id, prompt_ids, sampling, script):
                        if fail_after is not None and out.completion_tokens > fail_after:
                            raise RuntimeError("injected engine failure")
                        yield out
                finally:
                    self.running -= 1
                    self.finished += 1
        finally:
            if waiting:
                self.waiting -= 1

    async def _generate(self, request_id, prompt_ids, sampling, script):
        if script is None:
            seed = sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, ()))
            steps = generate_steps(self.model, torch.tensor([prompt_ids]), sampling,
                                   torch.Generator().manual_seed(seed))
        count = 0
        while True:
            if request_id in self._abort:
                yield self._out(request_id, [], None, True, "abort", prompt_ids, count)
                return
            if script is None:
                # the model runs in a worker thread, so the event loop keeps serving other requests
                step = await asyncio.to_thread(next, steps, None)
                token, logprob = int(step.tokens[0]), step.logprobs[0]
            else:
                token, logprob = script[count], None
                await asyncio.sleep(0)
            count += 1
            logprobs = [logprob] if logprob is not None else None
            if token in sampling.stop_token_ids or (script is not None and count == len(script)):
                yield self._out(request_id, [token], logprobs, True, "stop", prompt_ids, count)
                return
            if count >= sampling.max_tokens:
                yield self._out(request_id, [token], logprobs, True, "length", prompt_ids, count)
                return
            yield self._out(request_id, [token], logprobs, False, None, prompt_ids, count)

    @staticmethod
    def _out(request_id, ids, logprobs, finished, reason, prompt_ids, count):
        return RequestOutput(request_id, ids, logprobs=logprobs, finished=finished, finish_reason=reason,
                             prompt_tokens=len(prompt_ids), cached_tokens=0, completion_tokens=count)
