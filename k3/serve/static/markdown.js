// A small markdown renderer for model replies: fenced code, headings, lists, block quotes, tables, rules,
// paragraphs; inline code, links, bold, italic, strikethrough. Safe by construction: every piece of the
// source is HTML-escaped before it reaches the output, which holds only the tags written here; link targets
// must be http(s), mailto or relative. An unclosed fence (a reply still streaming) renders as code so far.

export function escapeHTML(text) {
  return text.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?/;
const ITEM = /^( {0,3})([-*+]|\d{1,9}[.)])\s+(.*)$/;
const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;
const SAFE_LINK = /^(https?:\/\/|mailto:|[#/.?]|[^:]*$)/i;

function startsBlock(line, next) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line)
    || (line.includes("|") && next !== undefined && TABLE_RULE.test(next) && next.includes("-"));
}

// Inline spans of one block of text. Code spans and links are built first and stashed behind \u0000 markers,
// so emphasis never reaches inside them.
export function renderInline(text) {
  const stash = [];
  const keep = (html) => `\u0000${stash.push(html) - 1}\u0000`;
  let s = text.replace(/\u0000/g, "");
  s = s.replace(/(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/g,
                (_, __, code) => keep(`<code>${escapeHTML(code.trim() || code)}</code>`));
  s = escapeHTML(s);
  s = s.replace(/\[([^\]\n]+)\]\(([^()\s]+)\)/g, (whole, label, href) => {
    const target = href.replace(/&amp;/g, "&");
    if (!SAFE_LINK.test(target)) return whole;
    return keep(`<a href="${href}" target="_blank" rel="noopener noreferrer">${label}</a>`);
  });
  s = s.replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^\w])__(?=\S)([\s\S]*?\S)__(?!\w)/g, "$1<strong>$2</strong>")
    .replace(/(^|[^*\w])\*(?=[^\s*])([\s\S]*?[^\s*])\*(?!\*)/g, "$1<em>$2</em>")
    .replace(/(^|[^\w])_(?=[^\s_])([\s\S]*?[^\s_])_(?!\w)/g, "$1<em>$2</em>")
    .replace(/~~(?=\S)([\s\S]*?\S)~~/g, "<del>$1</del>")
    .replace(/\n/g, "<br>");
  const restore = (t) => t.replace(/\u0000(\d+)\u0000/g, (_, i) => restore(stash[Number(i)]));
  return restore(s);
}

function cells(line) {
  return line.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((c) => c.trim());
}

function codeBlock(lang, code) {
  const label = lang ? `<span class="lang">${escapeHTML(lang)}</span>` : "<span></span>";
  const cls = lang ? ` class="language-${escapeHTML(lang)}"` : "";
  return `<div class="code"><div class="code-head">${label}<button type="button" class="copy-code">copy</button>`
    + `</div><pre><code${cls}>${escapeHTML(code)}</code></pre></div>`;
}

export function renderMarkdown(source) {
  const lines = source.replace(/\r\n?/g, "\n").split("\n");
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if ((m = line.match(FENCE))) {
      const [fence, lang] = [m[1], m[2]];
      const body = [];
      i++;
      while (i < lines.length && !new RegExp(`^ {0,3}${fence[0]}{${fence.length},}\\s*$`).test(lines[i])) {
        body.push(lines[i++]);
      }
      if (i >= lines.length && body[body.length - 1] === "") body.pop();  // unclosed: no newline after the code so far
      i++;
      out.push(codeBlock(lang, body.join("\n")));
    } else if (!line.trim()) {
      i++;
    } else if ((m = line.match(HEADING))) {
      const n = m[1].length;
      out.push(`<h${n}>${renderInline(m[2])}</h${n}>`);
      i++;
    } else if (RULE.test(line)) {
      out.push("<hr>");
      i++;
    } else if (QUOTE.test(line)) {
      const body = [];
      while (i < lines.length && QUOTE.test(lines[i])) body.push(lines[i++].replace(QUOTE, ""));
      out.push(`<blockquote>${renderMarkdown(body.join("\n"))}</blockquote>`);
    } else if (ITEM.test(line)) {
      const ordered = /\d/.test(line.match(ITEM)[2]);
      const items = [];
      while (i < lines.length) {
        const item = lines[i].match(ITEM);
        if (item && /\d/.test(item[2]) === ordered) {
          items.push(item[3]);
        } else if (items.length && /^\s{2,}\S/.test(lines[i])) {
          items[items.length - 1] += "\n" + lines[i].trim();  // a continuation line (nesting is flattened)
        } else {
          break;
        }
        i++;
      }
      const start = ordered ? parseInt(line.match(ITEM)[2], 10) : 1;
      const tag = ordered ? "ol" : "ul";
      const attr = ordered && start !== 1 ? ` start="${start}"` : "";
      out.push(`<${tag}${attr}>${items.map((t) => `<li>${renderInline(t)}</li>`).join("")}</${tag}>`);
    } else if (line.includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1])
               && lines[i + 1].includes("-")) {
      const head = cells(line);
      i += 2;
      const rows = [];
      while (i < lines.length && lines[i].includes("|") && lines[i].trim()) rows.push(cells(lines[i++]));
      const th = head.map((c) => `<th>${renderInline(c)}</th>`).join("");
      const trs = rows.map((r) => `<tr>${head.map((_, k) => `<td>${renderInline(r[k] || "")}</td>`).join("")}</tr>`);
      out.push(`<table><thead><tr>${th}</tr></thead><tbody>${trs.join("")}</tbody></table>`);
    } else {
      const body = [line];
      i++;
      while (i < lines.length && lines[i].trim() && !startsBlock(lines[i], lines[i + 1])) body.push(lines[i++]);
      out.push(`<p>${renderInline(body.join("\n"))}</p>`);
    }
  }
  return out.join("\n");
}
