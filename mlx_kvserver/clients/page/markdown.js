// A small Markdown renderer for untrusted text (model output). It builds DOM nodes and sets only
// textContent and a checked href: no HTML in the input is ever parsed, so "<script>" or
// "<img onerror>" show as the characters they are. Handles fenced code, headings, lists, quotes,
// rules, pipe tables, paragraphs; inline code, bold, italic, strikethrough, links (http, https,
// mailto only) and backslash escapes. An unclosed fence (an answer still streaming) runs to the end.

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?/;
const ITEM = /^( *)([-*+]|\d{1,9}[.)])\s+/;
const TABLE_SEP = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;
const INLINE = new RegExp([
  /\\([\\`*_{}[\]()#+\-.!~|>])/,                       // 1 escaped character
  /(`+)([^`]|[^`][\s\S]*?[^`])\2(?!`)/,                 // 2, 3 code span
  /\*\*(?=\S)([\s\S]*?\S)\*\*/,                         // 4 bold
  /__(?=\S)([\s\S]*?\S)__(?!\w)/,                       // 5 bold
  /~~(?=\S)([\s\S]*?\S)~~/,                             // 6 strikethrough
  /\*(?=[^\s*])([\s\S]*?[^\s*])\*/,                     // 7 italic
  /(?<![\w])_(?=[^\s_])([\s\S]*?[^\s_])_(?![\w])/,      // 8 italic
  /\[([^\]\n]+)\]\(\s*<?((?:[^()\s<>]|\([^()\s]*\))+)>?\s*\)/, // 9, 10 link
  /(https?:\/\/[^\s<>()]*[^\s<>().,;:!?'"*_~])/,        // 11 bare URL
].map((r) => r.source).join("|"), "g");

/** A new element with a class and text (textContent: never parsed as HTML). */
export function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

export function safeHref(url) {
  try {
    const parsed = new URL(url, window.location.href);
    return ["http:", "https:", "mailto:"].includes(parsed.protocol) ? parsed.href : null;
  } catch {
    return null;
  }
}

/** A link to http(s) or mailto only; `label` is Markdown, or null to show the URL as is. */
function link(label, href, parent) {
  const safe = safeHref(href);
  if (!safe) return false;
  const a = el("a");
  a.href = safe;
  a.rel = "noopener noreferrer nofollow";
  a.target = "_blank";
  if (label === null) a.textContent = href;
  else renderInline(label, a);
  parent.append(a);
  return true;
}

/** Appends the inline Markdown of `text` to `parent` as text nodes and elements. */
export function renderInline(text, parent) {
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) parent.append(text.slice(last, m.index));
    last = m.index + m[0].length;
    if (m[1] !== undefined) parent.append(m[1]);
    else if (m[3] !== undefined) parent.append(el("code", null, m[3]));
    else if (m[4] !== undefined || m[5] !== undefined) renderInline(m[4] ?? m[5], parent.appendChild(el("strong")));
    else if (m[6] !== undefined) renderInline(m[6], parent.appendChild(el("del")));
    else if (m[7] !== undefined || m[8] !== undefined) renderInline(m[7] ?? m[8], parent.appendChild(el("em")));
    else if (m[9] !== undefined) {
      if (!link(m[9], m[10], parent)) parent.append(m[0]);
    } else if (!link(null, m[11], parent)) parent.append(m[0]);
  }
  if (last < text.length) parent.append(text.slice(last));
}

function codeBlock(lang, code) {
  const pre = el("pre", "code");
  const bar = el("div", "code-bar");
  bar.append(el("span", "code-lang", lang || "text"));
  const copy = el("button", "code-copy", "copy");
  copy.type = "button";
  copy.addEventListener("click", () => {
    navigator.clipboard?.writeText(code).then(() => { copy.textContent = "copied"; }, () => {});
  });
  bar.append(copy);
  const c = el("code", lang ? `lang-${lang.replace(/[^\w-]/g, "")}` : null, code);
  pre.append(bar, c);
  return pre;
}

function splitRow(line) {
  let s = line.trim();
  if (s.startsWith("|")) s = s.slice(1);
  if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
  return s.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, "|"));
}

function table(lines) {
  const t = el("table");
  const head = t.appendChild(el("thead")).appendChild(el("tr"));
  for (const cell of splitRow(lines[0])) renderInline(cell, head.appendChild(el("th")));
  const body = t.appendChild(el("tbody"));
  for (const line of lines.slice(2)) {
    const tr = body.appendChild(el("tr"));
    for (const cell of splitRow(line)) renderInline(cell, tr.appendChild(el("td")));
  }
  const wrap = el("div", "table-wrap");
  wrap.append(t);
  return wrap;
}

function isBlockStart(line, next) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) ||
    ITEM.test(line) || (line.includes("|") && next !== undefined && TABLE_SEP.test(next) && next.includes("-"));
}

function list(lines, i, parent) {
  const first = lines[i].match(ITEM);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const items = [];
  for (; i < lines.length; i++) {
    const line = lines[i];
    const m = line.match(ITEM);
    const deeper = line.search(/\S/) > indent;
    if (m && m[1].length === indent && /\d/.test(m[2]) === ordered) {
      items.push([line.slice(m[0].length)]); // the next item
    } else if (line.trim() === "" && /^\s+\S/.test(lines[i + 1] ?? "")) {
      items.at(-1).push(""); // a blank line inside an item
    } else if (line.trim() !== "" && deeper) {
      items.at(-1).push(line.slice(Math.min(line.search(/\S/), indent + 4))); // nested lines
    } else if (line.trim() !== "" && !m && !isBlockStart(line, lines[i + 1])) {
      items.at(-1).push(line); // a lazy continuation line
    } else break;
  }
  const node = el(ordered ? "ol" : "ul");
  const start = parseInt(first[2], 10);
  if (ordered && start !== 1) node.start = start;
  for (const body of items) {
    const li = node.appendChild(el("li"));
    if (body.slice(1).some((l) => isBlockStart(l))) renderBlocks(body, li);
    else renderInline(body.join("\n"), li);
  }
  parent.append(node);
  return i;
}

/** Appends the block-level Markdown of `lines` to `parent`. */
function renderBlocks(lines, parent) {
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (line.trim() === "") { i++; continue; }
    if ((m = line.match(FENCE))) {
      const close = new RegExp(`^ {0,3}${m[1][0] === "`" ? "`" : "~"}{${m[1].length},}\\s*$`);
      const body = [];
      for (i++; i < lines.length && !close.test(lines[i]); i++) body.push(lines[i]);
      i++;
      parent.append(codeBlock(m[2], body.join("\n")));
    } else if ((m = line.match(HEADING))) {
      renderInline(m[2], parent.appendChild(el(`h${Math.min(6, m[1].length + 2)}`)));
      i++;
    } else if (RULE.test(line)) {
      parent.append(el("hr"));
      i++;
    } else if (QUOTE.test(line)) {
      const body = [];
      for (; i < lines.length && lines[i].trim() !== "" ; i++) body.push(lines[i].replace(QUOTE, ""));
      renderBlocks(body, parent.appendChild(el("blockquote")));
    } else if (ITEM.test(line)) {
      i = list(lines, i, parent);
    } else if (line.includes("|") && i + 1 < lines.length && TABLE_SEP.test(lines[i + 1]) && lines[i + 1].includes("-")) {
      const rows = [line, lines[i + 1]];
      for (i += 2; i < lines.length && lines[i].includes("|") && lines[i].trim() !== ""; i++) rows.push(lines[i]);
      parent.append(table(rows));
    } else {
      const body = [line];
      for (i++; i < lines.length && lines[i].trim() !== "" && !isBlockStart(lines[i], lines[i + 1]); i++) body.push(lines[i]);
      renderInline(body.join("\n"), parent.appendChild(el("p"))); // line breaks kept (CSS)
    }
  }
}

/** The rendered Markdown of `text`, as a DocumentFragment. */
export function renderMarkdown(text) {
  const fragment = document.createDocumentFragment();
  renderBlocks(String(text ?? "").replace(/\r\n?/g, "\n").split("\n"), fragment);
  return fragment;
}
