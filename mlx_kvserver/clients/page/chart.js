// A small inline-SVG chart of a conversation's turns: one bar per answer for its prompt tokens,
// the part that came from the cache filled in; a line for the time to first token.

const NS = "http://www.w3.org/2000/svg";
const W = 300;
const H = 96;
const PAD = { left: 6, right: 6, top: 14, bottom: 14 };

function svg(tag, attrs = {}, text) {
  const node = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

/** `turns`: [{prompt, cached, ttft, rate}], oldest first. Returns an <svg> element. */
export function turnChart(turns) {
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "turn-chart", role: "img" });
  root.append(svg("title", {}, "prompt tokens per turn (filled: from the cache) and time to first token"));
  if (!turns.length) return root;
  const shown = turns.slice(-30);
  const innerW = W - PAD.left - PAD.right;
  const innerH = H - PAD.top - PAD.bottom;
  const slot = innerW / shown.length;
  const maxPrompt = Math.max(1, ...shown.map((t) => t.prompt || 0));
  const maxTtft = Math.max(0.001, ...shown.map((t) => t.ttft || 0));
  const points = [];
  shown.forEach((t, i) => {
    const x = PAD.left + i * slot + slot * 0.15;
    const w = Math.max(1, slot * 0.7);
    const h = (innerH * (t.prompt || 0)) / maxPrompt;
    const hc = (innerH * Math.min(t.cached || 0, t.prompt || 0)) / maxPrompt;
    const bar = svg("rect", { x, y: PAD.top + innerH - h, width: w, height: h, class: "bar-prompt" });
    bar.append(svg("title", {}, `turn ${turns.length - shown.length + i + 1}: ${t.cached}/${t.prompt} ` +
      `prompt tokens cached, ttft ${t.ttft == null ? "-" : `${t.ttft.toFixed(3)} s`}`));
    root.append(bar, svg("rect", { x, y: PAD.top + innerH - hc, width: w, height: hc, class: "bar-cached" }));
    if (t.ttft != null) points.push([x + w / 2, PAD.top + innerH - (innerH * t.ttft) / maxTtft]);
  });
  if (points.length) {
    root.append(svg("polyline", { points: points.map((p) => p.join(",")).join(" "), class: "ttft-line" }));
    for (const [x, y] of points) root.append(svg("circle", { cx: x, cy: y, r: 2, class: "ttft-dot" }));
  }
  root.append(
    svg("text", { x: PAD.left, y: 10, class: "chart-label" }, `prompt tokens (max ${maxPrompt}), cached filled`),
    svg("text", { x: W - PAD.right, y: 10, class: "chart-label ttft-label", "text-anchor": "end" },
      `ttft (max ${maxTtft.toFixed(2)} s)`),
    svg("text", { x: PAD.left, y: H - 2, class: "chart-label" }, `turns ${turns.length - shown.length + 1}-${turns.length}`),
  );
  return root;
}
