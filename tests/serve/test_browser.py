"""The chat page and the dashboard in a real headless browser: Playwright for Python driving the system's
Chromium (Debian's `chromium`), as a person would use them.

Most tests run against `k3 serve --preset debug` started here as a subprocess (the real engine, random weights,
the byte tokenizer). Random weights write garbage, so those tests check behaviour: text grows while it streams,
stop frees the request on the server, the settings reach the request, a 4xx reads as an error, a reload keeps
the conversation, the dashboard follows the engine. Replies a random model will not write (reasoning, markdown,
a tool call) come from the scriptable fake engine, served under a path prefix with an API key.

Each test leaves a screenshot in its tmp_path. `K3_CHAT_SCREENSHOT=docs/figures/chat-page.png` also writes the
README's figure (from the scripted conversation). Without Playwright or Chromium the browser tests skip, saying
which; the HTTP checks of the pages' routes at the end run anyway.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.serve.conftest import LiveServer, real_engine_available

CHROMIUM = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CONTEXT = 2048
API_KEY = "sekrit"
# greedy decoding of the debug preset's random weights (seed 0) writes several hundred tokens after this
LONG_PROMPT = "Hello"


def find_chromium() -> tuple[str | None, str]:
    """(the browser to drive, "") or (None, why the browser tests cannot run here)."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return None, "playwright is not installed (pip install playwright)"
    path = os.environ.get("K3_CHROMIUM") or next(filter(None, map(shutil.which, CHROMIUM)), None)
    if path is None:
        return None, "no Chromium on PATH (apt-get install chromium, or set K3_CHROMIUM)"
    return path, ""


CHROMIUM_PATH, NO_BROWSER = find_chromium()
pytestmark = pytest.mark.skipif(not real_engine_available(), reason="needs k3.infer.engine")


def wait_until(condition, timeout: float, what: str, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)


def wait_js(page, expression: str, what: str, timeout: float = 30):
    """Poll a JS expression from outside the page (the pages' CSP forbids the eval of `page.wait_for_function`)."""
    return wait_until(lambda: page.evaluate(expression), timeout, what)


def prometheus(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return float(re.search(rf"^k3_{name} (\S+)$", text, re.MULTILINE).group(1))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`k3 serve --preset debug` in a subprocess on a free port: its base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    cmd = [sys.executable, "-m", "k3.cli", "serve", "--preset", "debug", "--device", "cpu", "--port", str(port),
           "--max-context", str(CONTEXT), "--log-level", "warning"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, f"k3 serve exited: {log.read_text()}"
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(up, 120, "k3 serve to start", every=0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium, or a skip saying why not. Every browser test asks for `page` first, so a machine
    without a browser starts no server for them."""
    if CHROMIUM_PATH is None:
        pytest.skip(NO_BROWSER)
    from playwright.sync_api import Error, sync_playwright

    with sync_playwright() as p:
        try:
            chromium = p.chromium.launch(executable_path=CHROMIUM_PATH, headless=True)
        except Error as e:  # a browser that is there but cannot start (missing libraries, no sandbox)
            pytest.skip(f"{CHROMIUM_PATH} does not start under Playwright: {e}")
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser, tmp_path):
    """A fresh browser context (empty local storage); its screenshot is left in tmp_path; an uncaught script
    error fails the test."""
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    context.set_default_timeout(10_000)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("dialog", lambda d: errors.append(f"unexpected {d.type}: {d.message}"))
    yield page
    page.screenshot(path=tmp_path / "page.png", full_page=True)
    context.close()
    assert not errors, errors


def open_chat(page, url: str) -> None:
    page.goto(url + "/")
    page.wait_for_selector("body[data-ready]")


def set_value(page, selector: str, value) -> None:
    page.fill(selector, str(value))
    page.dispatch_event(selector, "change")


def send(page, text: str):
    """Type a message and send it; returns the request the page made."""
    with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as request:
        page.fill("#prompt", text)
        page.press("#prompt", "Enter")
    return request.value


def wait_reply(page, timeout: float = 60) -> None:
    wait_js(page, "!document.querySelector('.msg.streaming')", "the reply to finish", timeout)


def stats(page) -> str:
    return page.locator(".msg.assistant").last.locator(".stats").inner_text()


def test_reply_streams_with_usage(page, server):
    open_chat(page, server)
    set_value(page, "#temperature", 0)
    set_value(page, "#max-tokens", 200)
    body = send(page, LONG_PROMPT).post_data_json
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["messages"] == [{"role": "user", "content": LONG_PROMPT}] and body["model"] == "k3-debug"
    content = page.locator(".msg.assistant .content")
    lengths, deadline = [], time.monotonic() + 60
    while page.locator(".msg.streaming").count():
        assert time.monotonic() < deadline, "the reply did not finish"
        lengths.append(content.evaluate("e => e.textContent.length"))
        time.sleep(0.02)
    # it grew piece by piece (markdown may shorten the text when a `**` closes, so not strictly monotonic)
    assert sum(b > a for a, b in itertools.pairwise(lengths)) >= 3, lengths
    line = stats(page)
    assert re.search(r"TTFT \d+", line) and re.search(r"[\d.]+ tok/s", line), line
    assert "prompt " in line and "cached " in line and "completion 200" in line and "length" in line, line


def test_stop_frees_the_request(page, server):
    open_chat(page, server)
    set_value(page, "#temperature", 0)
    set_value(page, "#max-tokens", 1500)
    finished = prometheus(server, "requests_finished_total")
    send(page, LONG_PROMPT)
    wait_js(page, "document.querySelector('.msg.assistant .content').textContent.length > 10", "streamed text")
    wait_until(lambda: prometheus(server, "requests_running") == 1, 5, "the request to run on the server")
    page.click("#stop")
    wait_until(lambda: prometheus(server, "requests_running") == 0, 5, "the server's running count to drop to 0")
    assert prometheus(server, "kv_pages_used") == 0 and prometheus(server, "kda_slots_used") == 0
    assert prometheus(server, "requests_finished_total") == finished + 1
    assert page.locator(".msg.assistant .stats .stopped").is_visible()
    assert "completion" not in stats(page)  # it did not run to its end
    assert page.locator("#send").is_visible() and not page.locator("#stop").is_visible()


def test_settings_and_effort_reach_the_request(page, server):
    open_chat(page, server)
    page.fill("#system", "You are terse.")
    page.select_option("#effort", "max")
    set_value(page, "#temperature", 0)
    set_value(page, "#top-p", 0.9)
    set_value(page, "#max-tokens", 24)
    body = send(page, "Stop me if you can.").post_data_json
    assert body["reasoning_effort"] == "max"
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0, 0.9, 24)
    assert body["messages"][0] == {"role": "system", "content": "You are terse."}
    wait_reply(page)
    # the server rendered thinking mode: the reply is reasoning, counted in the usage, shown collapsed
    reasoning = page.locator(".msg.assistant .reasoning")
    assert reasoning.is_visible() and reasoning.get_attribute("open") is None
    assert re.fullmatch(r"Reasoning \([1-9]\d* tokens\)", reasoning.locator("summary").inner_text())
    reasoning.locator("summary").click()
    assert reasoning.get_attribute("open") is not None and reasoning.locator(".body").inner_text()
    stored = page.evaluate("JSON.parse(localStorage.getItem('k3.conversations'))")[0]["messages"][1]

    page.select_option("#effort", "none")
    body = send(page, "And now?").post_data_json
    assert "reasoning_effort" not in body
    # the earlier reply goes back with its reasoning, so the new prompt extends the old one
    assert body["messages"][2]["role"] == "assistant"
    assert body["messages"][2]["reasoning_content"] == stored["reasoning"] != ""
    wait_reply(page)


def test_error_is_readable_and_edit_resends(page, server):
    open_chat(page, server)
    set_value(page, "#max-tokens", 16)
    send(page, "x" * (CONTEXT + 100))
    wait_reply(page)
    error = page.locator(".msg.assistant .error")
    assert error.is_visible() and error.get_attribute("role") == "alert"
    text = error.inner_text()
    assert "The server refused the request" in text and "HTTP 400" in text and "context_length_exceeded" in text
    assert f"this model's context is {CONTEXT} tokens" in text, text
    assert page.locator("#send").is_enabled()

    # edit the over-long message: what followed it goes, the new text is sent
    page.locator(".msg.user .edit").click()
    page.fill(".msg.user .edit-area", "Hello again")
    with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as request:
        page.locator(".msg.user .resend").click()
    assert request.value.post_data_json["messages"] == [{"role": "user", "content": "Hello again"}]
    wait_reply(page)
    assert page.locator(".msg").count() == 2 and not page.locator(".error").is_visible()
    assert "completion" in stats(page)


def test_regenerate_replaces_the_reply(page, server):
    open_chat(page, server)
    set_value(page, "#max-tokens", 8)
    send(page, "Say something.")
    wait_reply(page)
    with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as request:
        page.locator(".msg.assistant .regenerate").click()
    assert request.value.post_data_json["messages"] == [{"role": "user", "content": "Say something."}]
    wait_reply(page)
    assert page.locator(".msg.assistant").count() == 1 and "completion" in stats(page)


def test_reload_keeps_the_conversation(page, server):
    open_chat(page, server)
    set_value(page, "#temperature", 0.5)
    set_value(page, "#max-tokens", 12)
    send(page, "Remember me.")
    wait_reply(page)
    reply, line = page.locator(".msg.assistant .content").inner_html(), stats(page)
    page.reload()
    page.wait_for_selector("body[data-ready]")
    assert page.locator(".msg.user .body").inner_text() == "Remember me."
    assert page.locator(".msg.assistant .content").inner_html() == reply and stats(page) == line
    assert page.locator("#conversations .active .conv").inner_text() == "Remember me."
    assert page.input_value("#temperature") == "0.5" and page.input_value("#max-tokens") == "12"
    page.click("#new-chat")
    assert page.locator(".msg").count() == 0 and page.locator("#conversations li").count() == 2
    page.locator("#conversations .conv", has_text="Remember me.").click()
    assert page.locator(".msg").count() == 2


def test_images_are_off_on_a_text_model(page, server):
    open_chat(page, server)
    info = httpx.get(server + "/ui/info").json()
    assert info["vision"] is False
    choosers = []
    page.on("filechooser", lambda chooser: choosers.append(chooser))
    attach = page.locator("#attach")
    assert attach.get_attribute("aria-disabled") == "true" and attach.get_attribute("title") == info["vision_note"]
    attach.click(force=True)  # aria-disabled: Playwright would wait for it to be enabled; a person can click it
    assert page.locator("#vision-note").inner_text() == info["vision_note"] and not choosers
    page.evaluate("""() => { document.getElementById('vision-note').hidden = true;
        const data = new DataTransfer();
        data.items.add(new File([new Uint8Array([137, 80, 78, 71])], 'shot.png', {type: 'image/png'}));
        document.getElementById('prompt').dispatchEvent(new ClipboardEvent('paste', {clipboardData: data})); }""")
    assert page.locator("#vision-note").is_visible() and page.locator("#attachments img").count() == 0


def test_dashboard_follows_the_engine(page, server):
    page.goto(server + "/dashboard")
    generated = page.locator("#tile-generated .value")
    wait_js(page, "document.querySelector('#tile-generated .value').textContent !== '–'", "the first poll")
    before = generated.inner_text()
    page.evaluate("window.loadedOnce = true")
    r = httpx.post(server + "/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16})
    assert r.status_code == 200
    wait_until(lambda: generated.inner_text() != before, 5, "the dashboard's numbers to change")
    assert page.evaluate("window.loadedOnce") is True  # updated in place, not reloaded
    assert int(generated.inner_text().replace(",", "")) > int(before.replace(",", ""))
    assert page.locator("#tile-spec .value").inner_text() == "not enabled"
    assert page.locator("#chart-spec .off").inner_text() == "not enabled"
    assert re.fullmatch(r"\d+ / \d+", page.locator("#tile-kda .value").inner_text())
    # the charts are drawn: the tokens chart's canvas differs from a blank one
    drawn = page.evaluate("""() => { const c = document.querySelector('#chart-tokens canvas');
        const blank = document.createElement('canvas'); blank.width = c.width; blank.height = c.height;
        return c.toDataURL() !== blank.toDataURL(); }""")
    assert drawn


def test_markdown_is_rendered_safely(page, server):
    open_chat(page, server)
    html = page.evaluate("""async () => {
        const { renderMarkdown } = await import('./static/markdown.js');
        return renderMarkdown('# T\\n**b** *i* `<b>c</b>` [ok](https://x.org) [bad](javascript:void)\\n\\n'
            + '<img src=x onerror=alert(1)>\\n\\n- a\\n- b\\n\\n| h | g |\\n|---|---|\\n| 1 | 2 |\\n\\n'
            + '```py\\n<script>\\n');
    }""")
    assert "<h1>T</h1>" in html and "<strong>b</strong>" in html and "<em>i</em>" in html
    assert "<code>&lt;b&gt;c&lt;/b&gt;</code>" in html and 'href="https://x.org"' in html
    assert 'href="javascript' not in html and "[bad](javascript:void)" in html
    assert "<img" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html
    assert "<ul><li>a</li><li>b</li></ul>" in html and "<td>2</td>" in html
    assert '<code class="language-py">&lt;script&gt;</code>' in html  # an unclosed fence: code so far


# ---- the app mounted under a path prefix, with an API key, over the scriptable fake engine

CITY_TOOL = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                              "parameters": {"type": "object",
                                                             "properties": {"city": {"type": "string"}}}}}]
FIRST = {"role": "assistant",
         "reasoning_content": "The user wants the weather in Paris. I have a tool for that, so I call it.",
         "content": "## Looking it up\nI will ask **get_weather** for Paris. The call, in Python, is:\n\n"
                    "```python\nget_weather(city=\"Paris\")  # <script>alert(1)</script>\n```",
         "tool_calls": [{"id": "call_0", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
SECOND = {"role": "assistant", "reasoning_content": "The tool says 21 degrees and sunny.",
          "content": "It is **21 °C** and sunny in Paris.\n\n| | today |\n|---|---|\n| sky | sunny |\n| °C | 21 |"}


def reply_tokens(template, message: dict) -> list[int]:
    """What a model in thinking mode writes after the generation prompt to produce `message`."""
    head = template.open_tag("think")
    return template.assistant_body(message, thinking=True)[len(head):] + [template.end_id]


@pytest.fixture(scope="module")
def prefixed(model):
    """The app mounted at /k3 of an outer app (as behind a proxy at a path prefix), with an API key, over the
    fake engine: (engine, the outer base URL)."""
    from starlette.applications import Starlette
    from starlette.routing import Mount

    from k3.chat.template import ChatTemplate
    from k3.serve.app import create_app
    from k3.tokenizer import byte_tokenizer
    from tests.serve.fake_engine import FakeEngine

    tokenizer = byte_tokenizer(model.config.vocab_size)
    engine = FakeEngine(model, tokenizer.vocab_size)
    template = ChatTemplate(tokenizer)
    engine.script = [reply_tokens(template, FIRST), reply_tokens(template, SECOND)]
    app = create_app(engine, tokenizer, "k3-debug", api_key=API_KEY, max_context=CONTEXT)
    with LiveServer(Starlette(routes=[Mount("/k3", app=app)])) as server:
        yield engine, server.base_url


def test_behind_a_prefix_with_a_key_and_tool_calls(page, prefixed):
    _, base = prefixed
    urls: list[str] = []
    page.on("request", lambda r: urls.append(r.url) if r.url != base + "/k3" else None)
    page.goto(base + "/k3")  # the mount adds the slash
    assert page.url == base + "/k3/"
    page.wait_for_selector("#key-dialog[open]")
    page.fill("#key-input", "wrong")
    page.click("#key-submit")
    page.wait_for_selector("#key-error:not([hidden])")
    assert "did not accept" in page.inner_text("#key-error")
    page.fill("#key-input", API_KEY)
    page.click("#key-submit")
    page.wait_for_selector("body[data-ready]")
    assert page.inner_text("#model") == "k3-debug"

    page.select_option("#effort", "high")
    page.fill("#tools", json.dumps(CITY_TOOL))
    body = send(page, "What is the weather in Paris?").post_data_json
    assert body["tools"] == CITY_TOOL
    wait_reply(page)
    reply = page.locator(".msg.assistant").last
    assert reply.locator(".reasoning summary").inner_text().startswith("Reasoning (")
    assert reply.locator(".reasoning .body").text_content() == FIRST["reasoning_content"]
    assert reply.locator(".content h2").inner_text() == "Looking it up"
    assert reply.locator(".content strong").inner_text() == "get_weather"
    code = reply.locator(".content pre code.language-python")
    assert code.text_content() == 'get_weather(city="Paris")  # <script>alert(1)</script>'
    assert reply.locator("script").count() == 0
    call = reply.locator(".tool-call")
    assert call.locator(".tool-name").inner_text() == "get_weather"
    assert json.loads(call.locator(".tool-args").inner_text()) == {"city": "Paris"}
    assert "tool_calls" in reply.locator(".stats").inner_text()

    call.locator(".answer").click()
    call.locator(".edit-area").fill('{"temp": 21, "sky": "sunny"}')
    with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as request:
        call.locator(".send-result").click()
    messages = request.value.post_data_json["messages"]
    call_id = messages[1]["tool_calls"][0]["id"]
    function = messages[1]["tool_calls"][0]["function"]
    assert function["name"] == "get_weather" and json.loads(function["arguments"]) == {"city": "Paris"}
    assert messages[2] == {"role": "tool", "tool_call_id": call_id, "content": '{"temp": 21, "sky": "sunny"}'}
    wait_reply(page)
    last = page.locator(".msg.assistant").last
    assert last.locator(".content").inner_text().startswith("It is 21 °C and sunny in Paris.")
    assert last.locator(".content td").count() == 4
    assert all(u.startswith(base + "/k3/") for u in urls), [u for u in urls if not u.startswith(base + "/k3/")]
    figure = os.environ.get("K3_CHAT_SCREENSHOT")
    if figure:
        page.locator(".msg.assistant .reasoning").first.locator("summary").click()
        page.screenshot(path=figure)

    page.goto(base + "/k3/dashboard")
    wait_js(page, "document.querySelector('#tile-finished .value').textContent === '2'", "the fake engine's count")
    assert page.inner_text("#tile-kv .value") == "–"  # a metric this engine does not report
    assert all(u.startswith(base + "/k3/") for u in urls)


# ---- the pages' routes over HTTP (no browser)


def test_pages_over_http(prefixed):
    from k3.serve.pages import MEDIA_TYPES, STATIC

    engine, base = prefixed
    page = httpx.get(base + "/k3/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"] and 'src="static/chat.js"' in page.text
    assert "static/dashboard.js" in httpx.get(base + "/k3/dashboard").text
    for path in STATIC.iterdir():  # what ships in the package is what the routes serve
        r = httpx.get(f"{base}/k3/static/{path.name}")
        assert r.status_code == 200 and r.content == path.read_bytes()
        assert r.headers["content-type"] == MEDIA_TYPES[path.suffix]
    for name in ["..%2Fpages.py", "nope.js", ".hidden", "..%2F..%2Fapp.py"]:
        r = httpx.get(f"{base}/k3/static/{name}")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", name
    # the pages and what they read need no key; the API does
    info = httpx.get(base + "/k3/ui/info").json()
    assert info["api_key_required"] is True and info["vision"] is False and "text only" in info["vision_note"]
    metrics = httpx.get(base + "/k3/ui/metrics").json()
    assert metrics["metrics"] == engine.metrics() and metrics["time"] > 0
    assert httpx.get(base + "/k3/v1/models").status_code == 401


def test_flat_metrics():
    from k3.infer.metrics import EngineMetrics
    from k3.serve.pages import flat_metrics

    m = EngineMetrics()
    m.observe("time_to_first_token_seconds", 0.5)
    m.inc("generation_tokens_total", 7)
    flat = flat_metrics({**m.snapshot(), "kv_utilization": float("nan"), "requests_running": 2})
    assert flat["time_to_first_token_seconds_sum"] == 0.5 and flat["time_to_first_token_seconds_count"] == 1
    assert flat["generation_tokens_total"] == 7 and flat["requests_running"] == 2
    assert "kv_utilization" not in flat and "time_to_first_token_seconds" not in flat
    json.dumps(flat, allow_nan=False)
