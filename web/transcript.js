// The conversation kept across reloads (localStorage) and exported as text or JSON.
//
// The page's log is the one record: every change to it is saved (debounced), and a
// reload shows it again. The server keeps no history across connections, so a restored
// conversation is for reading; the assistant starts afresh.

import { KEYS, readJSON, writeJSON } from "./store.js";
import { metricRows } from "./ui.js";

const SAVE_DELAY_MS = 250;
const MAX_ENTRIES = 400; // the oldest go first when a long conversation outgrows this

export function loadTranscript() {
  const saved = readJSON(KEYS.transcript, null);
  return saved && Array.isArray(saved.entries) ? saved.entries : [];
}

/** Save `entries()` whenever `log` changes; returns a function that saves at once. */
export function keepTranscript(log, entries) {
  let timer = null;
  const save = () => {
    clearTimeout(timer);
    timer = null;
    const all = entries();
    writeJSON(KEYS.transcript, all.length ? { version: 1, entries: all.slice(-MAX_ENTRIES) } : null);
  };
  new MutationObserver(() => {
    if (timer === null) timer = setTimeout(save, SAVE_DELAY_MS);
  }).observe(log, { childList: true, subtree: true, characterData: true, attributes: true });
  // A reload or a closed tab must not lose the last words.
  window.addEventListener("pagehide", () => timer !== null && save());
  return save;
}

const WHO = { user: "You", assistant: "Parley", notice: "Note" };

function clock(time) {
  if (!time) return "";
  const d = new Date(time);
  return Number.isNaN(d.getTime()) ? "" : d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit" });
}

export function asText(entries, now = new Date()) {
  const lines = [`Parley conversation, exported ${now.toISOString()}`, ""];
  for (const e of entries) {
    const when = clock(e.time);
    const flags = [e.interrupted && "interrupted", e.incomplete && "incomplete"].filter(Boolean);
    const tail = flags.length ? ` (${flags.join(", ")})` : "";
    lines.push(`${when ? `[${when}] ` : ""}${WHO[e.role] || e.role}: ${e.text}${tail}`);
    for (const t of e.tools || []) lines.push(`    called ${t.call} ${t.result}`);
    const rows = metricRows(e.metrics);
    if (rows.length) lines.push(`    ${rows.map(([label, value]) => `${label} ${value}`).join(", ")}`);
  }
  return lines.join("\n") + "\n";
}

export function asJSON(entries, now = new Date()) {
  return JSON.stringify({ format: "parley-conversation", version: 1, exported_at: now.toISOString(), entries }, null, 2);
}

/** Offer `content` as a file download (a blob URL: nothing leaves the browser). */
export function download(filename, content, type) {
  const url = URL.createObjectURL(new Blob([content], { type }));
  const a = document.createElement("a");
  a.href = url;
  a.download = filename;
  a.hidden = true;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}

export function exportName(ext, now = new Date()) {
  const pad = (n) => String(n).padStart(2, "0");
  const stamp = `${now.getFullYear()}${pad(now.getMonth() + 1)}${pad(now.getDate())}-${pad(now.getHours())}${pad(now.getMinutes())}${pad(now.getSeconds())}`;
  return `parley-conversation-${stamp}.${ext}`;
}
