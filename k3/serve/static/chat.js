// The chat page. Conversations live in the browser's local storage; each turn streams one reply from
// `v1/chat/completions` (reasoning, content and tool calls as they arrive, then the usage), and shows its
// time to first token, decode speed and token counts. Stop closes the stream, which aborts the request on the
// server; regenerate and edit-and-resend cut the conversation and ask again. The settings (system prompt,
// reasoning effort, temperature, top-p, max tokens, tools) go into every request; a tool call the model makes
// is shown as such and can be answered by hand with the tool's result.

import { apiKey, getJSON, setApiKey, streamChat } from "./api.js";
import { renderMarkdown } from "./markdown.js";

const STORE = "k3.conversations";
const CURRENT = "k3.current";
const SETTINGS = "k3.settings";
// the sampling defaults are `k3 chat`'s
const DEFAULTS = { effort: "none", temperature: 0.7, top_p: 0.95, max_tokens: 512, tools: "" };
const NUMBERS = { temperature: "temperature", top_p: "top-p", max_tokens: "max-tokens" };  // setting -> input id

const $ = (id) => document.getElementById(id);

function load(key, fallback) {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch {
    return fallback;
  }
}

const settings = { ...DEFAULTS, ...load(SETTINGS, {}) };
const conversations = load(STORE, []);
let currentId = localStorage.getItem(CURRENT) || null;
let info = { api_key_required: false, vision: false, vision_note: "" };
let model = null;  // the card from v1/models
let busy = null;  // { controller, msg } while a reply streams
let attachments = [];  // data URLs of the images for the next message

// a reply cut off by a reload (or a closed tab) stays as far as it got
for (const c of conversations) {
  for (const m of c.messages) {
    if (m.pending) Object.assign(m, { pending: false, stopped: true });
  }
}

function save() {
  try {
    localStorage.setItem(STORE, JSON.stringify(conversations));
    localStorage.setItem(CURRENT, currentId || "");
  } catch (e) {
    // the browser's quota (a few MB per site; attached images count): the page goes on, unsaved
    status(`not saved in local storage: ${e.message}`, true);
  }
}

function current() {
  return conversations.find((c) => c.id === currentId) || null;
}

function newConversation() {
  const id = Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
  const conv = { id, title: "New chat", system: "", messages: [], updated: Date.now() };
  conversations.push(conv);
  currentId = id;
  save();
  return conv;
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function button(text, className, onClick, title) {
  const b = el("button", className, text);
  b.type = "button";
  if (title) b.title = title;
  b.addEventListener("click", onClick);
  return b;
}

function status(text, isError = false) {
  $("status").textContent = text;
  $("status").classList.toggle("error-text", isError);
}

// ---- rendering

function renderList() {
  const list = $("conversations");
  list.textContent = "";
  for (const conv of [...conversations].sort((a, b) => b.updated - a.updated)) {
    const item = el("li", conv.id === currentId ? "active" : "");
    item.append(
      button(conv.title, "conv", () => {
        if (busy) return;
        currentId = conv.id;
        save();
        renderAll();
      }),
      button("×", "delete", () => {
        if (busy) return;
        conversations.splice(conversations.indexOf(conv), 1);
        if (currentId === conv.id) currentId = null;
        save();
        renderAll();
      }, "Delete this conversation"),
    );
    list.append(item);
  }
}

function renderAll() {
  renderList();
  $("system").value = current()?.system || "";
  renderMessages();
}

function renderMessages() {
  const box = $("messages");
  box.textContent = "";
  const conv = current();
  if (!conv || !conv.messages.length) {
    box.append(el("p", "empty", "Start a conversation below. Replies stream in as the model writes them."));
    return;
  }
  const render = { user: userElement, assistant: assistantElement, tool: toolElement };
  conv.messages.forEach((m, i) => box.append(render[m.role](conv, m, i)));
  box.scrollTop = box.scrollHeight;
}

function userElement(conv, m, i) {
  const node = el("article", "msg user");
  node.dataset.index = i;
  const body = el("div", "body", m.content);
  node.append(body);
  for (const src of m.images || []) {
    const img = el("img", "thumb");
    img.src = src;
    img.alt = "attached image";
    node.append(img);
  }
  const actions = el("div", "actions");
  actions.append(button("edit", "edit", () => editMessage(conv, i, node), "Edit this message and send it again"));
  node.append(actions);
  return node;
}

function toolElement(conv, m, i) {
  const node = el("article", "msg tool");
  node.dataset.index = i;
  const head = el("div", "tool-head");
  head.append(el("span", "tool-label", "tool result"), el("span", "tool-name", m.name || ""),
              el("span", "tool-id", m.tool_call_id));
  node.append(head, el("pre", "tool-args", m.content));
  return node;
}

function assistantElement(conv, m, i) {
  const node = el("article", "msg assistant");
  node.dataset.index = i;
  const reasoning = el("details", "reasoning");
  reasoning.append(el("summary"), el("div", "body markdown"));
  reasoning.open = Boolean(m.pending);
  node.append(reasoning, el("div", "content markdown"), el("div", "tool-calls"), el("div", "error"),
              el("div", "stats"));
  const actions = el("div", "actions");
  if (i === conv.messages.length - 1) {
    actions.append(button("regenerate", "regenerate", () => regenerate(conv, i), "Ask for this reply again"));
  }
  actions.append(button("copy", "copy-message", () => copyText(m.content), "Copy the reply"));
  node.append(actions);
  fillAssistant(node, m);
  // the calls of the latest reply (only tool results after it) that have no result yet can be answered
  const later = conv.messages.slice(i + 1);
  if (later.every((x) => x.role === "tool")) {
    node.querySelectorAll(".tool-call").forEach((box, k) => {
      const call = m.tool_calls[k];
      if (later.some((x) => x.tool_call_id === call.id)) return;
      box.append(button("answer", "answer", () => answerCall(conv, i, call, box), "Send this tool's result"));
    });
  }
  return node;
}

// (Re)fill an assistant message's parts in place, so an open or closed reasoning block keeps its state.
function fillAssistant(node, m) {
  node.classList.toggle("streaming", Boolean(m.pending));
  const reasoning = node.querySelector(".reasoning");
  reasoning.hidden = !m.reasoning;
  if (m.reasoning) {
    reasoning.querySelector("summary").textContent = m.pending && !m.content ? "Thinking…"
      : `Reasoning (${m.usage?.completion_tokens_details?.reasoning_tokens || m.reasoning.length}`
        + `${m.usage?.completion_tokens_details?.reasoning_tokens ? " tokens" : " characters"})`;
    reasoning.querySelector(".body").innerHTML = renderMarkdown(m.reasoning);
  }
  node.querySelector(".content").innerHTML = renderMarkdown(m.content);
  const tools = node.querySelector(".tool-calls");
  tools.textContent = "";
  for (const call of m.tool_calls || []) {
    const box = el("div", "tool-call");
    const head = el("div", "tool-head");
    head.append(el("span", "tool-label", "tool call"), el("span", "tool-name", call.name || "?"),
                el("span", "tool-id", call.id || ""));
    let args = call.arguments || "";
    try {
      args = JSON.stringify(JSON.parse(args), null, 2);
    } catch {
      // still streaming, or not JSON: shown as it came
    }
    box.append(head, el("pre", "tool-args", args));
    tools.append(box);
  }
  const error = node.querySelector(".error");
  error.textContent = "";
  error.hidden = !m.error;
  if (m.error) {
    error.setAttribute("role", "alert");
    const refused = m.error.status >= 400 && m.error.status < 500;
    error.append(el("strong", "", refused ? "The server refused the request" : "The request failed"),
                 el("span", "detail", m.error.detail || ""),
                 el("div", "message", m.error.message));
  }
  const stats = node.querySelector(".stats");
  stats.textContent = "";
  for (const [cls, text, title] of statsOf(m)) {
    const span = el("span", cls, text);
    span.title = title;
    stats.append(span, " ");
  }
}

function formatSeconds(ms) {
  return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(2)} s`;
}

// [class, text, title] of each number shown under a reply
function statsOf(m) {
  const s = m.stats || {};
  const u = m.usage;
  const out = [];
  if (s.ttft_ms != null) out.push(["ttft", `TTFT ${formatSeconds(s.ttft_ms)}`, "time to first token"]);
  if (u && s.decode_s > 0 && u.completion_tokens > 1) {
    const rate = (u.completion_tokens - 1) / s.decode_s;
    out.push(["tps", `${rate.toFixed(1)} tok/s`, "tokens per second after the first"]);
  }
  if (u) {
    out.push(["prompt", `prompt ${u.prompt_tokens}`, "prompt tokens"]);
    out.push(["cached", `cached ${u.prompt_tokens_details?.cached_tokens ?? 0}`,
              "prompt tokens served by the prefix cache"]);
    out.push(["completion", `completion ${u.completion_tokens}`, "completion tokens"]);
  }
  if (m.stopped) out.push(["finish stopped", "stopped", "stopped before the end"]);
  else if (m.finish_reason && m.finish_reason !== "stop") out.push(["finish", m.finish_reason, "finish reason"]);
  return out;
}

function scrollDown() {
  const box = $("messages");
  if (box.scrollHeight - box.scrollTop - box.clientHeight < 200) box.scrollTop = box.scrollHeight;
}

function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    navigator.clipboard.writeText(text).catch(() => {});
    return;
  }
  const area = el("textarea");
  area.value = text;
  document.body.append(area);
  area.select();
  document.execCommand("copy");
  area.remove();
}

// ---- requests

function requestMessages(conv) {
  const out = [];
  if (conv.system.trim()) out.push({ role: "system", content: conv.system });
  for (const m of conv.messages) {
    if (m.role === "user") {
      const images = (m.images || []).map((u) => ({ type: "image_url", image_url: { url: u } }));
      out.push({ role: "user", content: images.length ? [{ type: "text", text: m.content }, ...images] : m.content });
    } else if (m.role === "tool") {
      out.push({ role: "tool", tool_call_id: m.tool_call_id, content: m.content });
    } else if (!m.error && (m.content || m.reasoning || m.tool_calls?.length)) {
      const reply = { role: "assistant", content: m.content };
      // sent back so the next prompt extends this one token for token (a prefix-cache hit)
      if (m.reasoning) reply.reasoning_content = m.reasoning;
      if (m.tool_calls?.length) {
        reply.tool_calls = m.tool_calls.map((t) => ({ id: t.id, type: "function",
                                                      function: { name: t.name, arguments: t.arguments } }));
      }
      out.push(reply);
    }
  }
  return out;
}

function requestBody(conv) {
  const body = { messages: requestMessages(conv), stream: true, stream_options: { include_usage: true },
                 temperature: settings.temperature, top_p: settings.top_p, max_tokens: settings.max_tokens };
  if (model) body.model = model.id;
  if (settings.effort !== "none") body.reasoning_effort = settings.effort;
  const tools = parseTools(settings.tools);
  if (Array.isArray(tools) && tools.length) body.tools = tools;
  return body;
}

function addToolCall(calls, delta) {
  let call = calls.find((c) => c.index === delta.index);
  if (!call) {
    call = { index: delta.index, id: "", name: "", arguments: "" };
    calls.push(call);
  }
  if (delta.id) call.id = delta.id;
  if (delta.function?.name) call.name = delta.function.name;
  if (delta.function?.arguments) call.arguments += delta.function.arguments;
}

async function generate(conv) {
  const body = requestBody(conv);
  const msg = { role: "assistant", content: "", reasoning: "", tool_calls: [], pending: true };
  conv.messages.push(msg);
  conv.updated = Date.now();
  save();
  renderAll();
  const node = $("messages").lastElementChild;
  busy = { controller: new AbortController(), msg };
  setBusy(true);
  const t0 = performance.now();
  let first = null;
  let last = null;
  let frame = 0;
  const paint = () => {
    frame = 0;
    fillAssistant(node, msg);
    scrollDown();
  };
  try {
    for await (const chunk of streamChat(body, busy.controller.signal)) {
      if (chunk.usage) msg.usage = chunk.usage;
      const choice = chunk.choices?.[0];
      if (!choice) continue;
      const d = choice.delta || {};
      if (d.content || d.reasoning_content || d.tool_calls?.length) {
        last = performance.now();
        first ??= last;
      }
      if (d.reasoning_content) msg.reasoning += d.reasoning_content;
      if (d.content) msg.content += d.content;
      for (const call of d.tool_calls || []) addToolCall(msg.tool_calls, call);
      if (choice.finish_reason) msg.finish_reason = choice.finish_reason;
      frame ||= requestAnimationFrame(paint);
    }
  } catch (e) {
    if (e.name === "AbortError") {
      msg.stopped = true;
    } else {
      msg.error = { message: e.message, detail: e.detail || "", status: e.status || 0 };
      if (e.status === 401) {
        setApiKey("");
        connect("The server did not accept the key.");
      }
    }
  } finally {
    if (frame) cancelAnimationFrame(frame);
    msg.pending = false;
    msg.stats = first === null ? {} : { ttft_ms: first - t0, decode_s: (last - first) / 1000 };
    busy = null;
    conv.updated = Date.now();
    save();
    setBusy(false);
    // drawn afresh: the reasoning folds, the reply gets its buttons (answer a tool call)
    renderMessages();
  }
}

function setBusy(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  $("new-chat").disabled = on;
  document.body.classList.toggle("busy", on);
}

function sendPrompt() {
  const text = $("prompt").value.trim();
  if (busy || (!text && !attachments.length)) return;
  const conv = current() || newConversation();
  const message = { role: "user", content: text };
  if (attachments.length) message.images = attachments;
  conv.messages.push(message);
  if (conv.title === "New chat") conv.title = (text || "image").slice(0, 48);
  $("prompt").value = "";
  attachments = [];
  renderAttachments();
  generate(conv);
}

function regenerate(conv, i) {
  if (busy) return;
  conv.messages.splice(i);
  generate(conv);
}

// The result of one tool call of reply i, written by hand as a tool message; once every call of the reply
// has its result, the model goes on.
function answerCall(conv, i, call, box) {
  if (busy) return;
  const area = el("textarea", "edit-area");
  area.placeholder = `what ${call.name} returned`;
  area.rows = 3;
  box.querySelector(".answer").remove();
  box.append(area, button("Send result", "send-result", () => {
    if (busy) return;
    conv.messages.push({ role: "tool", tool_call_id: call.id, name: call.name, content: area.value });
    const answered = new Set(conv.messages.slice(i + 1).map((x) => x.tool_call_id));
    if (conv.messages[i].tool_calls.every((c) => answered.has(c.id))) {
      generate(conv);
    } else {
      save();
      renderMessages();
    }
  }));
  area.focus();
}

function editMessage(conv, i, node) {
  if (busy) return;
  const area = el("textarea", "edit-area");
  area.value = conv.messages[i].content;
  area.rows = Math.min(12, area.value.split("\n").length + 1);
  const actions = el("div", "actions");
  actions.append(
    button("Send", "resend", () => {
      if (busy) return;
      conv.messages.splice(i + 1);
      conv.messages[i].content = area.value;
      generate(conv);
    }, "Replace this message, drop what follows it, and ask again"),
    button("Cancel", "cancel", renderMessages),
  );
  node.textContent = "";
  node.append(area, actions);
  area.focus();
}

// ---- images

function showNote(text) {
  $("vision-note").textContent = text;
  $("vision-note").hidden = false;
}

function renderAttachments() {
  const box = $("attachments");
  box.textContent = "";
  attachments.forEach((src, i) => {
    const img = el("img", "thumb");
    img.src = src;
    img.alt = "image to send";
    box.append(img, button("×", "remove", () => {
      attachments.splice(i, 1);
      renderAttachments();
    }, "Remove this image"));
  });
}

function addImages(files) {
  for (const file of files.filter((f) => f.type.startsWith("image/"))) {
    const reader = new FileReader();
    reader.onload = () => {
      attachments.push(reader.result);
      renderAttachments();
    };
    reader.readAsDataURL(file);
  }
}

function setupImages() {
  const attach = $("attach");
  if (info.vision) {
    attach.addEventListener("click", () => $("file").click());
  } else {
    // a text-only model: the button stays visible and says why it does nothing
    attach.setAttribute("aria-disabled", "true");
    attach.classList.add("disabled");
    attach.title = info.vision_note;
    attach.addEventListener("click", () => showNote(info.vision_note));
  }
  $("file").addEventListener("change", () => addImages([...$("file").files]));
  $("prompt").addEventListener("paste", (e) => {
    const files = [...(e.clipboardData?.files || [])].filter((f) => f.type.startsWith("image/"));
    if (!files.length) return;
    e.preventDefault();
    if (info.vision) addImages(files);
    else showNote(info.vision_note);
  });
}

// ---- settings, key, start

// the tools setting as a JSON array, or an Error saying what is wrong with it ("" is no tools)
function parseTools(text) {
  if (!text.trim()) return [];
  try {
    const tools = JSON.parse(text);
    return Array.isArray(tools) ? tools : new Error("tools must be a JSON array");
  } catch (e) {
    return new Error(`tools are not valid JSON: ${e.message}`);
  }
}

function bindSettings() {
  const keep = () => localStorage.setItem(SETTINGS, JSON.stringify(settings));
  $("effort").value = settings.effort;
  $("effort").addEventListener("change", () => {
    settings.effort = $("effort").value;
    keep();
  });
  for (const [key, id] of Object.entries(NUMBERS)) {
    const input = $(id);
    input.value = settings[key];
    input.addEventListener("change", () => {
      const v = Number(input.value);
      const lo = input.min === "" ? -Infinity : Number(input.min);
      const hi = input.max === "" ? Infinity : Number(input.max);
      if (input.value === "" || !Number.isFinite(v)) {
        input.value = settings[key];
        return;
      }
      settings[key] = Math.min(hi, Math.max(lo, key === "max_tokens" ? Math.round(v) : v));
      input.value = settings[key];
      keep();
    });
  }
  $("tools").value = settings.tools;
  $("tools").addEventListener("input", () => {
    settings.tools = $("tools").value;
    const tools = parseTools(settings.tools);
    $("tools-error").textContent = tools instanceof Error ? tools.message : "";
    $("tools-error").hidden = !(tools instanceof Error);
    keep();
  });
  $("system").addEventListener("input", () => {
    const conv = current() || newConversation();
    conv.system = $("system").value;
    save();
    renderList();
  });
}

function askKey(problem) {
  const dialog = $("key-dialog");
  $("key-error").textContent = problem || "";
  $("key-error").hidden = !problem;
  $("key-input").value = "";
  dialog.showModal();
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok" ? $("key-input").value.trim() : null),
                            { once: true });
  });
}

async function connect(problem = "") {
  for (;;) {
    if (info.api_key_required && !apiKey()) {
      const key = await askKey(problem);
      if (!key) {
        status("This server needs an API key.", true);
        return;
      }
      setApiKey(key);
    }
    try {
      model = (await getJSON("v1/models")).data[0];
    } catch (e) {
      if (e.status === 401) {
        setApiKey("");
        problem = "The server did not accept that key.";
        continue;
      }
      status(`cannot list the models: ${e.message}`, true);
      return;
    }
    $("model").textContent = model.id;
    $("model").title = `context ${model.max_model_len} tokens`;
    $("max-tokens").max = model.max_model_len;
    status("");
    document.body.dataset.ready = "true";
    return;
  }
}

async function main() {
  bindSettings();
  renderAll();
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    sendPrompt();
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      sendPrompt();
    }
  });
  $("stop").addEventListener("click", () => busy?.controller.abort());
  $("new-chat").addEventListener("click", () => {
    if (current()?.messages.length !== 0) newConversation();  // an empty conversation is already a new chat
    renderAll();
    $("prompt").focus();
  });
  $("messages").addEventListener("click", (e) => {
    if (e.target.classList.contains("copy-code")) copyText(e.target.closest(".code").querySelector("code").textContent);
  });
  $("change-key").addEventListener("click", () => {
    setApiKey("");
    connect();
  });
  try {
    info = await getJSON("ui/info");
  } catch (e) {
    status(`cannot reach the server: ${e.message}`, true);
  }
  $("change-key").hidden = !info.api_key_required;
  setupImages();
  await connect();
}

main();
