// The parts of an assistant message besides its text: a thinking model's reasoning, in a folded
// <details> block above the answer, and its tool calls, one compact block each (the name and the
// pretty-printed arguments). The message keeps them as the server sent them (reasoning_content,
// tool_calls) so the history sent back renders the same tokens and comes from the cache. Model
// output is untrusted: it reaches the DOM through textContent only.

import { el } from "./markdown.js";

/** Adds a streamed `delta` to `m` (content, reasoning_content, OpenAI tool-call deltas: a
 * call's first delta has its id and name, later ones append to its arguments). Returns what it
 * carried: {thought, text, call}. */
export function applyDelta(m, delta) {
  const str = (v) => (typeof v === "string" ? v : "");
  const thought = str(delta?.reasoning_content);
  const text = str(delta?.content);
  if (thought) m.reasoning_content = (m.reasoning_content ?? "") + thought;
  if (text) m.content += text;
  const calls = Array.isArray(delta?.tool_calls) ? delta.tool_calls : [];
  for (const call of calls) {
    if (!call || typeof call !== "object") continue;
    m.tool_calls ??= [];
    let k = call.index;
    if (!Number.isInteger(k) || k < 0 || k >= m.tool_calls.length) { // a new call
      k = m.tool_calls.length;
      m.tool_calls.push({ id: "", type: "function", function: { name: "", arguments: "" } });
    }
    const mine = m.tool_calls[k];
    mine.id = str(call.id) || mine.id;
    mine.function.name = str(call.function?.name) || mine.function.name;
    mine.function.arguments += str(call.function?.arguments);
  }
  return { thought: Boolean(thought), text: Boolean(text), call: calls.length > 0 };
}

/** The reasoning's time, once the answer (or a tool call, or the end) comes after it. */
export function endReasoning(m, started, now) {
  if (started != null && m.reasoning_content && m.reasoning_time == null) {
    m.reasoning_time = (now - started) / 1000;
  }
}

function reasoningLabel(m, live) {
  const n = (m.reasoning_content ?? "").length;
  const parts = [live ? "Reasoning…" : "Reasoning", `${n.toLocaleString("en")} chars`];
  if (m.reasoning_time != null) parts.push(`${m.reasoning_time.toFixed(1)} s`);
  return parts.join(" · ");
}

/** A <details> block with the reasoning of `m`: folded, unless `open`. */
export function reasoningView(m, open = false) {
  const details = el("details", "msg-reasoning");
  details.open = open;
  details.append(el("summary", "reasoning-summary"), el("div", "reasoning-body"));
  updateReasoning(details, m, open);
  return details;
}

/** Brings a reasoning block up to date with `m` (`live`: it is still streaming). */
export function updateReasoning(details, m, live) {
  details.dataset.state = live ? "streaming" : "done";
  details.querySelector(".reasoning-summary").textContent = reasoningLabel(m, live);
  details.querySelector(".reasoning-body").textContent = m.reasoning_content ?? "";
}

/** The arguments as indented JSON; as sent when they are not JSON (yet: still streaming). */
export function prettyArguments(text) {
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    return text;
  }
}

function toolCallView(call) {
  const box = el("div", "tool-call");
  const head = box.appendChild(el("div", "tool-call-head"));
  head.append(el("span", "tool-call-label", "tool call"),
    el("span", "tool-call-name", call.function?.name || "?"));
  if (call.id) head.append(el("span", "tool-call-id", call.id));
  box.append(el("pre", "tool-call-args", prettyArguments(call.function?.arguments ?? "")));
  return box;
}

/** The tool calls of a message, one block each. */
export function toolCallsView(calls) {
  const list = el("div", "msg-tools");
  list.append(...calls.map(toolCallView));
  return list;
}

/** What the store keeps of a message's tool calls: OpenAI's shape, strings only. */
export function cleanToolCalls(calls) {
  if (!Array.isArray(calls)) return null;
  const str = (v) => (typeof v === "string" ? v : "");
  const out = calls.filter((c) => c && typeof c === "object").map((c) => ({
    id: str(c.id), type: "function",
    function: { name: str(c.function?.name), arguments: str(c.function?.arguments) },
  }));
  return out.length ? out : null;
}
