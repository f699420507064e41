// The server's API, same-origin (relative URLs, so the page also works behind a path prefix).
// A 401 asks for the API key (through `askKey`) and tries again; the key is kept for this tab,
// or in localStorage when the user ticks "remember".

const KEY_STORE = "mlx-kvchat.api-key";

export class ApiError extends Error {
  constructor(status, message, body) {
    super(message);
    this.status = status;
    this.body = body;
  }
}

function describe(status, body) {
  const head = status ? `HTTP ${status}` : "server error";
  const err = body && typeof body === "object" ? body.error : null;
  if (err && typeof err === "object") return `${head}${err.type ? ` ${err.type}` : ""}: ${err.message}`;
  return `${head}: ${String(body ?? "").slice(0, 300)}`;
}

async function errorOf(response) {
  let body = null;
  try {
    body = await response.json();
  } catch { /* not JSON */ }
  return new ApiError(response.status, describe(response.status, body), body);
}

export class Client {
  /** `askKey(message)` resolves to {key, remember} or null when the user gives up. */
  constructor(askKey) {
    this.askKey = askKey;
    this.key = sessionStorage.getItem(KEY_STORE) ?? localStorage.getItem(KEY_STORE);
  }

  setKey(key, remember) {
    this.key = key || null;
    sessionStorage.setItem(KEY_STORE, key);
    if (remember) localStorage.setItem(KEY_STORE, key);
    else localStorage.removeItem(KEY_STORE);
  }

  forgetKey() {
    this.key = null;
    sessionStorage.removeItem(KEY_STORE);
    localStorage.removeItem(KEY_STORE);
  }

  /** fetch() with the key; on a 401 asks for a key and tries again. Throws ApiError on >= 400. */
  async fetch(path, options = {}) {
    for (let prompt = "This server needs an API key."; ;) {
      const headers = { ...(options.headers ?? {}) };
      if (this.key) headers.Authorization = `Bearer ${this.key}`;
      const response = await fetch(path, { ...options, headers });
      if (response.status === 401) {
        const answer = await this.askKey(this.key ? "That key was not accepted." : prompt);
        if (!answer) throw await errorOf(response);
        this.setKey(answer.key, answer.remember);
        prompt = "That key was not accepted.";
        continue;
      }
      if (!response.ok) throw await errorOf(response);
      return response;
    }
  }

  async json(path, options) {
    return (await this.fetch(path, options)).json();
  }

  /** Streams a chat completion: yields the parsed chunks; an error event throws ApiError. */
  async *chat(body, signal) {
    const response = await this.fetch("v1/chat/completions", {
      method: "POST", signal, headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
    });
    yield* parseSSE(response.body, signal);
  }
}

/** The JSON payloads of an SSE body's `data:` events, up to `[DONE]`. */
export async function* parseSSE(stream, signal) {
  const reader = stream.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let data = [];
  const dispatch = () => {
    const payload = data.join("\n");
    data = [];
    if (payload.trim() === "[DONE]") return null;
    let event;
    try {
      event = JSON.parse(payload);
    } catch {
      throw new ApiError(502, `the server sent a malformed event: ${payload.slice(0, 200)}`);
    }
    if (event && event.error) throw new ApiError(0, describe(0, event), event);
    return event;
  };
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      const lines = buffer.split(/\r\n|\r|\n/);
      buffer = lines.pop();
      for (const line of lines) {
        if (line === "") {
          if (!data.length) continue;
          const event = dispatch();
          if (event === null) return;
          yield event;
        } else if (!line.startsWith(":")) {
          const colon = line.indexOf(":");
          const name = colon < 0 ? line : line.slice(0, colon);
          let text = colon < 0 ? "" : line.slice(colon + 1);
          if (text.startsWith(" ")) text = text.slice(1);
          if (name === "data") data.push(text);
        }
      }
    }
    if (data.length) {
      const event = dispatch();
      if (event !== null) yield event;
    }
  } finally {
    if (!signal?.aborted) reader.cancel().catch(() => {});
  }
}
