// The cache panel: the server's memory budget, its KV cache per model (GET v1/kv_cache/stats, speculative decoding
// included) and the entries of the open conversation's messages (GET v1/kv_cache/{id}), each
// with export and delete.

import { ApiError } from "./client.js";

export function bytes(n) {
  if (n == null) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = Number(n);
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return `${i ? v.toFixed(1) : v} ${units[i]}`;
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function row(table, label, value, used, budget) {
  const tr = table.appendChild(el("tr"));
  tr.append(el("th", null, label));
  const td = tr.appendChild(el("td", null, value));
  if (budget) {
    const meter = el("meter");
    meter.min = 0;
    meter.max = budget;
    meter.value = used;
    meter.high = budget * 0.9;
    td.append(meter);
  }
  return tr;
}

function modelStats(name, s) {
  const box = el("section", "cache-model");
  box.dataset.model = name;
  box.append(el("h4", null, name));
  const t = box.appendChild(el("table", "kv"));
  const lookups = s.hits + s.misses;
  row(t, "hits", `${s.hits} of ${lookups} lookups${s.disk_hits ? ` (${s.disk_hits} from disk)` : ""}`).dataset.stat = "hits";
  row(t, "tokens from cache", String(s.tokens_served)).dataset.stat = "tokens";
  const r = s.ram;
  row(t, "RAM", `${bytes(r.bytes)} of ${bytes(r.budget_bytes)}`, r.bytes, r.budget_bytes).dataset.stat = "ram";
  row(t, "RAM entries", `${r.entries} (${r.pages_held} pages held, ${r.pages_cached} cached)`).dataset.stat = "ram-entries";
  row(t, "shared", bytes(r.bytes_shared)).dataset.stat = "shared";
  const d = s.disk;
  if (d) {
    row(t, "disk", `${bytes(d.bytes_on_disk)} of ${bytes(d.budget)}`, d.bytes_on_disk, d.budget).dataset.stat = "disk";
    row(t, "disk entries", String(d.entries)).dataset.stat = "disk-entries";
  } else row(t, "disk", "off").dataset.stat = "disk";
  row(t, "evictions", `RAM ${r.evictions}, disk ${d ? d.evictions : "-"}`).dataset.stat = "evictions";
  const st = s.store;
  if (st) {
    const state = st.breaker === "closed" ? "" : ` — ${st.breaker}, not asked`;
    row(t, "shared store", `${st.hits} hits, ${st.misses} misses; ${st.pages_read} pages read ` +
      `(${bytes(st.bytes_read)}), ${st.pages_written} written${state}`).dataset.stat = "store";
    row(t, "store problems", `${st.errors} errors, ${st.bad_values} bad values, ` +
      `${st.dropped_pages} pages dropped`).dataset.stat = "store-problems";
  }
  const rr = s.reread;
  if (rr) {
    const last = rr.last;
    const where = last ? `; last: token ${last.position}` +
      `${last.message_index == null ? "" : ` (message ${last.message_index})`}: ` +
      `"${last.prompt_excerpt}" was "${last.cached_excerpt}"` : "";
    row(t, "re-read", `${rr.tokens} tokens in ${rr.turns} turns${where}`).dataset.stat = "reread";
  }
  const im = s.images;
  if (im) { // a vision model: its encoder's runs, and the images whose features were kept
    row(t, "images", `${im.encoder_runs} encoded, ${im.feature_hits_memory + im.feature_hits_disk} ` +
      `read from the cache (${im.feature_hits_disk} from disk)`).dataset.stat = "images";
  }
  const sp = s.speculation;
  if (sp) { // the mode, the acceptance rate, tokens per decode step (one pass, the whole batch)
    row(t, "speculation", sp.mode).dataset.stat = "speculation";
    row(t, "drafts taken", sp.drafted ? `${sp.accepted} of ${sp.drafted} ` +
      `(${(100 * sp.accepted / sp.drafted).toFixed(1)}%)` : "none").dataset.stat = "drafts";
    row(t, "tokens per step", sp.decode_steps ? `${(sp.tokens / sp.decode_steps).toFixed(2)} ` +
      `(${sp.tokens} tokens in ${sp.decode_steps} passes)` : "-").dataset.stat = "per-step";
  }
  return box;
}

function memoryStats(m) { // the server's one budget: what is spent of it, and on what
  const box = el("section", "cache-model cache-memory");
  box.append(el("h4", null, "memory"));
  const t = box.appendChild(el("table"));
  const used = m.mlx_active_bytes;
  row(t, "in use", `${bytes(used)} of ${bytes(m.limit_bytes)}`, used, m.limit_bytes).dataset.stat = "memory";
  row(t, "weights", bytes(m.weights_bytes)).dataset.stat = "weights";
  row(t, "pages", bytes(m.pages_bytes)).dataset.stat = "pages";
  if (m.features_bytes) row(t, "image features", bytes(m.features_bytes)).dataset.stat = "features";
  row(t, "working", bytes(m.working_bytes)).dataset.stat = "working";
  row(t, "process", `${bytes(m.outside_mlx_bytes)} outside MLX, ${bytes(m.margin_bytes)} kept free`)
    .dataset.stat = "process";
  row(t, "pressure", `${m.pressure_events} times short, ${m.refused} refused`).dataset.stat = "pressure";
  return box;
}

export class CachePanel {
  /** `conversation()` gives the open conversation (or null); `notify(text)` reports errors. */
  constructor(root, client, conversation, notify) {
    Object.assign(this, { root, client, conversation, notify });
    this.body = root.querySelector(".cache-body");
    root.querySelector(".cache-refresh").addEventListener("click", () => this.refresh());
    this.busy = false;
  }

  get open() {
    return !this.root.hidden;
  }

  async refresh() {
    if (this.busy) return;
    this.busy = true;
    this.root.dataset.state = "loading";
    try {
      const stats = await this.client.json("v1/kv_cache/stats");
      const entries = await this.entries();
      this.body.replaceChildren();
      const first = Object.values(stats.models ?? {})[0];
      if (first?.memory) this.body.append(memoryStats(first.memory));
      for (const [name, s] of Object.entries(stats.models ?? {})) this.body.append(modelStats(name, s));
      this.body.append(this.entryList(entries, Object.keys(stats.models ?? {}).length > 1));
    } catch (e) {
      this.notify(`cache panel: ${e.message}`);
    } finally {
      this.busy = false;
      this.root.dataset.state = "ready";
    }
  }

  async entries() {
    const conv = this.conversation();
    const found = [];
    for (const m of [...(conv?.messages ?? [])].reverse()) {
      if (!m.message_id) continue;
      try {
        found.push({ message: m, info: await this.client.json(`v1/kv_cache/${encodeURIComponent(m.message_id)}`) });
      } catch (e) {
        if (!(e instanceof ApiError && e.status === 404)) throw e;
      }
    }
    return found;
  }

  entryList(entries, showModel) {
    const box = el("section", "cache-entries");
    box.append(el("h4", null, "this conversation's entries"));
    if (!entries.length) box.append(el("p", "muted", "none cached"));
    for (const { message, info } of entries) {
      const item = box.appendChild(el("div", "cache-entry"));
      item.dataset.messageId = info.message_id;
      const where = [info.in_memory && "RAM", info.on_disk && "disk"].filter(Boolean).join(" + ");
      const label = `${message.role}: ${message.content.slice(0, 40) || "(empty)"}`;
      item.append(el("div", "entry-label", label),
        el("div", "entry-info muted", `${info.tokens} tokens, ${where || "-"}${showModel ? `, ${info.model}` : ""}`));
      const exp = item.appendChild(el("button", "entry-export", "export"));
      const del = item.appendChild(el("button", "entry-delete danger", "delete"));
      exp.type = del.type = "button";
      exp.addEventListener("click", () => this.export(info.message_id).catch((e) => this.notify(e.message)));
      del.addEventListener("click", () => this.remove(info.message_id).catch((e) => this.notify(e.message)));
    }
    return box;
  }

  async export(id) {
    const response = await this.client.fetch(`v1/kv_cache/export/${encodeURIComponent(id)}`);
    const url = URL.createObjectURL(await response.blob());
    const a = el("a");
    a.href = url;
    a.download = `kv-${id.replace(/[^\w.-]/g, "_")}.safetensors`;
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 60_000);
  }

  async remove(id) {
    await this.client.fetch(`v1/kv_cache/${encodeURIComponent(id)}`, { method: "DELETE" });
    await this.refresh();
  }
}
