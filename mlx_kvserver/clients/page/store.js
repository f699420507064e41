// Conversations in localStorage, each message with its message_id: the server keys its KV cache
// by those ids, so a reloaded page (or a restarted server with its disk cache) goes on from the
// cache. The stored form is {version: 1, current, conversations: [{id, title, model, created,
// updated, messages: [{role, content, message_id, images?, reasoning_content?, reasoning_time?,
// tool_calls?, stats?, model?}]}]}. A user message's images are data URLs (PNG, JPEG, WebP, GIF),
// kept so that a reloaded chat shows them and sends them again.

import { cleanImages } from "./images.js";
import { cleanToolCalls } from "./parts.js";

export const STORAGE_KEY = "mlx-kvchat.conversations.v1";
const SETTINGS_KEY = "mlx-kvchat.settings.v1";

/** A random id (crypto.getRandomValues works on plain-http LAN pages, randomUUID does not). */
export function newId(prefix) {
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  return `${prefix}-${Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("")}`;
}

function cleanMessage(m) {
  if (!m || !["system", "user", "assistant"].includes(m.role)) return null;
  const out = { role: m.role, content: String(m.content ?? "") };
  if (typeof m.message_id === "string" && m.message_id) out.message_id = m.message_id;
  if (m.role === "user") {
    const images = cleanImages(m.images);
    if (images) out.images = images;
  }
  if (m.role === "assistant") { // the reasoning and tool calls as the server sent them
    if (typeof m.reasoning_content === "string" && m.reasoning_content) {
      out.reasoning_content = m.reasoning_content;
    }
    if (Number.isFinite(m.reasoning_time)) out.reasoning_time = m.reasoning_time;
    const calls = cleanToolCalls(m.tool_calls);
    if (calls) out.tool_calls = calls;
  }
  if (m.stats && typeof m.stats === "object") out.stats = m.stats;
  if (typeof m.model === "string") out.model = m.model;
  return out;
}

function cleanConversation(c) {
  if (!c || typeof c.id !== "string" || !Array.isArray(c.messages)) return null;
  return {
    id: c.id,
    title: String(c.title ?? "New chat"),
    model: typeof c.model === "string" ? c.model : null,
    created: Number(c.created) || Date.now(),
    updated: Number(c.updated) || Date.now(),
    messages: c.messages.map(cleanMessage).filter(Boolean),
  };
}

export class Store {
  constructor(storage = window.localStorage) {
    this.storage = storage;
    this.conversations = [];
    this.current = null;
    this.error = null;
    this.load();
  }

  load() {
    let data = null;
    try {
      data = JSON.parse(this.storage.getItem(STORAGE_KEY) ?? "null");
    } catch {
      this.error = "the saved conversations could not be read; starting afresh";
    }
    const list = Array.isArray(data?.conversations) ? data.conversations : [];
    this.conversations = list.map(cleanConversation).filter(Boolean);
    this.current = this.get(data?.current) ? data.current : this.conversations[0]?.id ?? null;
  }

  save() {
    try {
      this.storage.setItem(STORAGE_KEY, JSON.stringify({
        version: 1, current: this.current, conversations: this.conversations }));
      this.error = null;
    } catch (e) {
      this.error = `could not save the conversations in this browser: ${e.message}`;
    }
  }

  get(id) {
    return this.conversations.find((c) => c.id === id) ?? null;
  }

  get active() {
    return this.get(this.current);
  }

  /** Conversations, the most recently used first. */
  sorted() {
    return [...this.conversations].sort((a, b) => b.updated - a.updated);
  }

  create(model, messages = [], title = "New chat") {
    const now = Date.now();
    const conv = { id: newId("conv"), title, model, created: now, updated: now,
      messages: messages.map((m) => ({ ...m })) };
    this.conversations.push(conv);
    this.current = conv.id;
    this.save();
    return conv;
  }

  select(id) {
    if (this.get(id)) {
      this.current = id;
      this.save();
    }
  }

  remove(id) {
    this.conversations = this.conversations.filter((c) => c.id !== id);
    if (this.current === id) this.current = this.sorted()[0]?.id ?? null;
    this.save();
  }

  touch(conv) {
    conv.updated = Date.now();
    const first = conv.messages.find((m) => m.role === "user");
    if (conv.title === "New chat" && first) conv.title = first.content.slice(0, 60) || "(image)";
    this.save();
  }

  /** A new conversation with the messages up to and including `index`: the same message_ids,
   * so the fork goes on from the cache the original built. */
  fork(conv, index) {
    const fork = this.create(conv.model, conv.messages.slice(0, index + 1),
      `${conv.title} (fork)`);
    return fork;
  }
}

export function loadSettings() {
  try {
    return { maxTokens: "", temperature: "", ...JSON.parse(localStorage.getItem(SETTINGS_KEY) ?? "{}") };
  } catch {
    return { maxTokens: "", temperature: "" };
  }
}

export function saveSettings(settings) {
  try {
    localStorage.setItem(SETTINGS_KEY, JSON.stringify(settings));
  } catch { /* private mode: settings last for this page only */ }
}
