// How the pages talk to the server: the app's root URL, the API key, JSON requests, and the chat stream.
// Every URL is relative to the root, found from this module's own URL (<root>/static/api.js), so the pages
// work behind a proxy or a mount at any path prefix.

export const ROOT = new URL("../", import.meta.url);
const KEY = "k3.apiKey";

export function url(path) {
  return new URL(path, ROOT).href;
}

export function apiKey() {
  return localStorage.getItem(KEY) || "";
}

export function setApiKey(key) {
  if (key) localStorage.setItem(KEY, key);
  else localStorage.removeItem(KEY);
}

// An error the page shows as it is: the server's OpenAI error body, or what went wrong on the way.
export class APIError extends Error {
  constructor(message, { status = 0, type = "", code = "", param = "" } = {}) {
    super(message);
    this.name = "APIError";
    Object.assign(this, { status, type, code, param });
  }

  // "HTTP 400 · context_length_exceeded · param messages"
  get detail() {
    const parts = [];
    if (this.status) parts.push(`HTTP ${this.status}`);
    if (this.code || this.type) parts.push(this.code || this.type);
    if (this.param) parts.push(`param ${this.param}`);
    return parts.join(" · ");
  }
}

async function errorFrom(response) {
  const text = await response.text();
  let error = null;
  try {
    error = JSON.parse(text).error;
  } catch {
    // not an OpenAI error body (a proxy's page, say): show its first words
  }
  if (error && typeof error.message === "string") {
    return new APIError(error.message, { status: response.status, type: error.type, code: error.code,
                                         param: error.param });
  }
  const words = text.replace(/<[^>]*>/g, " ").replace(/\s+/g, " ").trim().slice(0, 200);
  return new APIError(words || response.statusText || "the server answered with an error",
                      { status: response.status });
}

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  const key = apiKey();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function send(path, init) {
  try {
    return await fetch(url(path), init);
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new APIError(`cannot reach the server (${e.message})`);
  }
}

export async function getJSON(path) {
  const response = await send(path, { headers: headers(false), cache: "no-store" });
  if (!response.ok) throw await errorFrom(response);
  return response.json();
}

// POST a streaming chat completion and yield its chunks (parsed `data:` events) until `[DONE]`. Throws an
// APIError for an error status or an error event, and the AbortError when `signal` aborts: closing the
// connection is what aborts the request on the server.
export async function* streamChat(body, signal) {
  const response = await send("v1/chat/completions",
                              { method: "POST", headers: headers(true), body: JSON.stringify(body), signal });
  if (!response.ok) throw await errorFrom(response);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      const events = buffer.split(/\r?\n\r?\n/);
      buffer = events.pop();
      for (const event of events) {
        const data = event.split(/\r?\n/).filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
        if (!data) continue;  // a `: ping` comment
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) {
          throw new APIError(chunk.error.message, { type: chunk.error.type, code: chunk.error.code,
                                                    param: chunk.error.param });
        }
        yield chunk;
      }
    }
    throw new APIError("the stream ended before [DONE]");
  } finally {
    // a consumer that stops early closes the connection too, so the server frees the request
    reader.cancel().catch(() => {});
  }
}
