// The chat page: conversations in the sidebar, streamed answers rendered as Markdown, edit /
// regenerate / fork, per-turn cache figures and a chart, the cache panel, model choice, images
// attached to a message (on a model that takes images) and the API-key prompt. Model output is untrusted: it reaches the DOM through textContent only (see
// markdown.js); this file never assigns HTML.

import { CachePanel } from "./cache.js";
import { turnChart } from "./chart.js";
import { Client } from "./client.js";
import { Attachments, imagesView, messageContent, pastedImages, readImage } from "./images.js";
import { el, renderMarkdown } from "./markdown.js";
import { applyDelta, endReasoning, reasoningView, toolCallsView, updateReasoning } from "./parts.js";
import { loadSettings, newId, saveSettings, Store, STORAGE_KEY } from "./store.js";

const $ = (id) => document.getElementById(id);
const store = new Store();
const settings = loadSettings();
let models = [];
let vision = new Set(); // the models that take images (capabilities.vision in /v1/models)
let streaming = null; // {controller, conv}
let pendingKey = null;
let answers = 0; // finished answers since the page loaded (in data-answers, for scripts and tests)

function showError(text) {
  $("error").textContent = text ?? "";
  $("error").hidden = !text;
}

/** The API-key dialog; one prompt at a time however many requests got a 401. */
function askKey(message) {
  pendingKey ??= new Promise((resolve) => {
    const dialog = $("key-dialog");
    const done = (answer) => {
      dialog.hidden = true;
      $("key-form").onsubmit = $("key-cancel").onclick = null;
      pendingKey = null;
      resolve(answer);
    };
    $("key-message").textContent = message;
    $("key-input").value = "";
    dialog.hidden = false;
    $("key-input").focus();
    $("key-form").onsubmit = (e) => {
      e.preventDefault();
      done({ key: $("key-input").value.trim(), remember: $("key-remember").checked });
    };
    $("key-cancel").onclick = () => done(null);
  });
  return pendingKey;
}

const client = new Client(askKey);
const cache = new CachePanel($("cache-panel"), client, () => store.active, showError);
const attached = new Attachments($("attachments"));

function currentModel(conv = store.active) {
  const wanted = conv?.model ?? settings.model;
  return models.includes(wanted) ? wanted : models[0] ?? null;
}

function statsText(s, model) {
  const ttft = s.ttft == null ? "-" : `${s.ttft.toFixed(3)} s`;
  const rate = s.rate == null ? "-" : s.rate.toFixed(1);
  const d = s.divergence;
  const reread = d ? ` · re-read ${d.reread_tokens} tokens from ` +
    (d.message_index == null ? `token ${d.position}` : `message ${d.message_index}`) : "";
  return `ttft ${ttft} · ${rate} tok/s · cached ${s.cached_tokens}/${s.prompt_tokens} prompt ` +
    `tokens${reread} · ${s.completion_tokens} tokens${draftText(s)}` +
    `${models.length > 1 && model ? ` · ${model}` : ""}`;
}

/** Speculative decoding: tokens per decode forward pass (completion_tokens / decode_steps: the
 * first token comes from the prompt's pass, and the end token, not counted, from the last decode
 * pass, so an answer that ends on its own reads 1.00 without drafts), and the draft tokens taken
 * where there were drafts. Nothing for answers saved before the server said. */
function draftText(s) {
  const parts = [];
  if (s.decode_steps > 0) {
    parts.push(`${(s.completion_tokens / s.decode_steps).toFixed(2)} tok/pass`);
  }
  if (s.drafted > 0) parts.push(`drafts: ${s.accepted} of ${s.drafted} taken`);
  return parts.map((p) => ` · ${p}`).join("");
}

function action(label, cls, handler) {
  const b = el("button", `act ${cls}`, label);
  b.type = "button";
  b.disabled = Boolean(streaming);
  b.addEventListener("click", handler);
  return b;
}

function messageView(conv, m, i) {
  const node = el("article", `msg msg-${m.role}`);
  node.dataset.role = m.role;
  node.dataset.index = String(i);
  if (m.message_id) node.dataset.messageId = m.message_id;
  const head = node.appendChild(el("div", "msg-head"));
  head.append(el("span", "msg-role", m.role === "assistant" ? "assistant" : m.role));
  const actions = head.appendChild(el("span", "msg-actions"));
  const last = i === conv.messages.length - 1;
  if (m.role === "user") {
    actions.append(action("edit", "act-edit", () => startEdit(conv, i, node)));
    if (last) actions.append(action("answer", "act-answer", () => generate(conv)));
  } else if (m.role === "assistant") {
    actions.append(action("regenerate", "act-regen", () => regenerate(conv, i)));
  }
  actions.append(action("fork here", "act-fork", () => fork(conv, i)));
  if (m.reasoning_content) node.append(reasoningView(m)); // folded
  if (m.images?.length) node.append(imagesView(m.images));
  const body = node.appendChild(el("div", "msg-body"));
  if (m.role === "assistant") body.append(renderMarkdown(m.content));
  else body.textContent = m.content;
  if (m.tool_calls?.length) node.append(toolCallsView(m.tool_calls));
  if (m.stats) {
    const stats = node.appendChild(el("div", "msg-stats", statsText(m.stats, m.model)));
    stats.dataset.cached = String(m.stats.cached_tokens);
    stats.dataset.prompt = String(m.stats.prompt_tokens);
    if (m.stats.decode_steps != null) stats.dataset.decodeSteps = String(m.stats.decode_steps);
    if (m.stats.drafted) stats.dataset.drafts = `${m.stats.accepted}/${m.stats.drafted}`;
  }
  return node;
}

function renderTurns(conv) {
  const turns = (conv?.messages ?? []).filter((m) => m.stats).map((m) => ({
    prompt: m.stats.prompt_tokens, cached: m.stats.cached_tokens, ttft: m.stats.ttft }));
  $("turns").hidden = !turns.length;
  $("turns-chart").replaceChildren(turnChart(turns));
  const prompt = turns.reduce((a, t) => a + t.prompt, 0);
  const cached = turns.reduce((a, t) => a + t.cached, 0);
  $("turns-summary").textContent = turns.length
    ? `${turns.length} turns: ${cached} of ${prompt} prompt tokens from the cache` : "";
}

function renderSidebar() {
  const list = $("conversations");
  list.replaceChildren();
  for (const conv of store.sorted()) {
    const li = list.appendChild(el("li", conv.id === store.current ? "active" : ""));
    li.dataset.id = conv.id;
    const open = li.appendChild(el("button", "conv-open", conv.title || "New chat"));
    open.type = "button";
    open.title = conv.title;
    open.addEventListener("click", () => { store.select(conv.id); render(); });
    const del = li.appendChild(el("button", "conv-delete", "×"));
    del.type = "button";
    del.title = "delete this conversation (its cache entries stay on the server)";
    del.disabled = streaming?.conv === conv;
    del.addEventListener("click", () => { store.remove(conv.id); render(); });
  }
}

function renderModels() {
  const select = $("model");
  select.replaceChildren(...models.map((name) => {
    const option = el("option", null, name);
    option.value = name;
    return option;
  }));
  $("model-choice").hidden = models.length < 2;
  select.value = currentModel() ?? "";
  renderAttach();
}

/** The attach control, shown only when the chosen model takes images. */
function renderAttach() {
  $("attach").hidden = !vision.has(currentModel());
}

/** Images chosen or pasted: read and added to the message being written. */
async function attach(files) {
  for (const file of files) {
    try {
      attached.add(await readImage(file));
    } catch (e) {
      showError(e.message);
    }
  }
}

function render() {
  const conv = store.active;
  $("title").textContent = conv?.title ?? "New chat";
  $("messages").replaceChildren(...(conv?.messages ?? []).map((m, i) => messageView(conv, m, i)));
  $("messages").scrollTop = $("messages").scrollHeight;
  renderTurns(conv);
  renderSidebar();
  if (models.length) $("model").value = currentModel() ?? "";
  renderAttach();
  if (cache.open && !streaming) cache.refresh(); // the stats wait for the answer otherwise
}

function setBusy(busy) {
  $("main").dataset.state = busy ? "streaming" : "idle";
  $("send").disabled = busy;
  $("stop").hidden = !busy;
}

/** A message as sent back: a user's with its images, an answer with its reasoning and tool calls
 * as the server sent them (the same tokens, so the turn comes from the cache). */
function sentMessage({ role, content, message_id, images, reasoning_content, tool_calls }) {
  const m = { role, content: role === "user" ? messageContent(content, images) : content };
  if (message_id) m.message_id = message_id;
  if (role === "assistant" && reasoning_content) m.reasoning_content = reasoning_content;
  if (role === "assistant" && tool_calls?.length) m.tool_calls = tool_calls;
  return m;
}

function requestBody(conv) {
  const body = { messages: conv.messages.map(sentMessage) };
  const model = currentModel(conv);
  if (model) body.model = model;
  if (settings.maxTokens !== "") body.max_tokens = Number(settings.maxTokens);
  if (settings.temperature !== "") body.temperature = Number(settings.temperature);
  return body;
}

/** Streams an answer to `conv`'s messages into a new assistant message. Returns false when
 * the request failed before any text came (the answer is dropped). */
async function generate(conv) {
  if (streaming) return false;
  showError("");
  const body = requestBody(conv);
  const reply = { role: "assistant", content: "", model: body.model };
  conv.messages.push(reply);
  streaming = { controller: new AbortController(), conv };
  setBusy(true);
  render();
  const view = $("messages").lastElementChild?.querySelector(".msg-body");
  let frame = 0;
  let thinking = null; // the reasoning block: open while it streams, folded when the answer starts
  let tools = null;
  const paint = () => {
    frame = 0;
    if (!view) return;
    if (reply.reasoning_content) {
      const live = reply.reasoning_time == null;
      if (!thinking) view.before(thinking = reasoningView(reply, live));
      else if (!live && thinking.dataset.state === "streaming") thinking.open = false;
      updateReasoning(thinking, reply, live);
    }
    view.replaceChildren(renderMarkdown(reply.content));
    if (reply.tool_calls?.length) {
      const next = toolCallsView(reply.tool_calls);
      if (tools) tools.replaceWith(next);
      else view.after(next);
      tools = next;
    }
    $("messages").scrollTop = $("messages").scrollHeight;
  };
  const t0 = performance.now();
  let tFirst = null;
  let tReasoning = null;
  let usage = null;
  let failed = null;
  try {
    for await (const chunk of client.chat(body, streaming.controller.signal)) {
      if (chunk.message_id) reply.message_id = chunk.message_id;
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices ?? []) {
        const got = applyDelta(reply, choice.delta);
        if (!got.thought && !got.text && !got.call) continue;
        const now = performance.now();
        tFirst ??= now; // the first token of any kind, reasoning included
        if (got.thought) tReasoning ??= now;
        if (got.text || got.call) endReasoning(reply, tReasoning, now);
        frame ||= requestAnimationFrame(paint);
      }
    }
  } catch (e) {
    if (e.name !== "AbortError") failed = e;
  }
  cancelAnimationFrame(frame);
  const tEnd = performance.now();
  endReasoning(reply, tReasoning, tEnd);
  if (usage) {
    const n = usage.completion_tokens;
    const details = usage.completion_tokens_details ?? {};
    const accepted = details.accepted_draft_tokens ?? 0; // the server's drafts, every source
    reply.stats = {
      ttft: tFirst == null ? null : (tFirst - t0) / 1000,
      rate: tFirst != null && n > 1 && tEnd > tFirst ? (n - 1) / ((tEnd - tFirst) / 1000) : null,
      prompt_tokens: usage.prompt_tokens, completion_tokens: n,
      cached_tokens: usage.prompt_tokens_details?.cached_tokens ?? 0,
      divergence: usage.kv_cache_divergence ?? null,
      decode_steps: usage.decode_steps ?? null,
      accepted, drafted: accepted + (details.rejected_draft_tokens ?? 0),
    };
  }
  const kept = Boolean(reply.content || reply.tool_calls?.length || usage);
  if (!kept) conv.messages.splice(conv.messages.indexOf(reply), 1);
  streaming = null;
  $("main").dataset.answers = String(++answers);
  setBusy(false);
  store.touch(conv);
  render();
  if (failed) showError(failed.message);
  else if (store.error) showError(store.error);
  return kept;
}

/** A user message: its text and, where it has any, its images. */
function userMessage(text, images) {
  const m = { role: "user", content: text, message_id: newId("user") };
  if (images.length) m.images = images;
  return m;
}

async function send(text, images) {
  const conv = store.active ?? store.create(currentModel());
  const message = userMessage(text, images);
  conv.messages.push(message);
  if (!(await generate(conv))) { // nothing came back: the message goes back to the input box
    conv.messages.splice(conv.messages.indexOf(message), 1);
    store.touch(conv);
    render();
    $("input").value = text;
    attached.set(images);
  }
}

function regenerate(conv, i) {
  conv.messages = conv.messages.slice(0, i); // the user's message keeps its id (and its cache)
  generate(conv);
}

function fork(conv, i) {
  store.fork(conv, i);
  render();
}

function startEdit(conv, i, node) {
  const body = node.querySelector(".msg-body");
  const box = el("div", "edit-box");
  const area = box.appendChild(el("textarea", "edit-input"));
  area.value = conv.messages[i].content;
  area.rows = Math.min(12, area.value.split("\n").length + 1);
  box.append(action("save and answer", "edit-save", () => {
    const text = area.value.trim();
    const images = conv.messages[i].images ?? [];
    if (!text && !images.length) return;
    // an edited message is a new message (its images kept): a new id; the messages before it
    // keep theirs
    conv.messages = [...conv.messages.slice(0, i), userMessage(text, images)];
    generate(conv);
  }), action("cancel", "edit-cancel", () => render()));
  body.replaceWith(box);
  area.focus();
}

function bind() {
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("input").value.trim();
    const images = attached.images;
    if ((!text && !images.length) || streaming) return;
    $("input").value = "";
    attached.set([]);
    send(text, images);
  });
  $("attach").addEventListener("click", () => $("attach-input").click());
  $("attach-input").addEventListener("change", async () => {
    const files = Array.from($("attach-input").files);
    $("attach-input").value = ""; // the same file can be chosen again
    await attach(files);
  });
  $("input").addEventListener("paste", (e) => {
    const files = pastedImages(e.clipboardData);
    if (!files.length) return; // text: pasted as usual
    if (!e.clipboardData.types.includes("text/plain")) e.preventDefault(); // (text goes in too)
    if (vision.has(currentModel())) attach(files);
    else showError(`${currentModel() ?? "this model"} does not take images`);
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => streaming?.controller.abort());
  $("new-chat").addEventListener("click", () => { store.create(currentModel(null)); render(); $("input").focus(); });
  $("model").addEventListener("change", () => {
    settings.model = $("model").value;
    saveSettings(settings);
    if (store.active) { store.active.model = settings.model; store.save(); }
    renderAttach();
  });
  $("toggle-cache").addEventListener("click", () => {
    const panel = $("cache-panel");
    panel.hidden = !panel.hidden;
    $("toggle-cache").setAttribute("aria-pressed", String(!panel.hidden));
    if (!panel.hidden) cache.refresh();
  });
  for (const [id, key] of [["max-tokens", "maxTokens"], ["temperature", "temperature"]]) {
    $(id).value = settings[key];
    $(id).addEventListener("change", () => { settings[key] = $(id).value.trim(); saveSettings(settings); });
  }
  $("forget-key").addEventListener("click", () => client.forgetKey());
  window.addEventListener("storage", (e) => { // another tab changed the conversations
    if (e.key === STORAGE_KEY && !streaming) {
      store.load();
      render();
    }
  });
}

async function init() {
  bind();
  render();
  if (store.error) showError(store.error);
  try {
    const listed = (await client.json("v1/models")).data;
    models = listed.map((m) => m.id);
    vision = new Set(listed.filter((m) => m.capabilities?.vision).map((m) => m.id));
  } catch (e) {
    showError(`cannot list the models: ${e.message}`);
  }
  renderModels();
  render();
  document.body.dataset.ready = "1";
}

init();
