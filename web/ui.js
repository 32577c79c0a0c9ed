// Everything that touches the DOM. The controller (app.js) decides *what* to show;
// this module decides *how*.

const $ = (id) => document.getElementById(id);

export const STATUS_TEXT = {
  connecting: "Connecting…",
  reconnecting: "Reconnecting…",
  ready: "Ready: press the mic to talk",
  starting: "Starting microphone…",
  listening: "Listening",
  user_speaking: "You're speaking",
  thinking: "Thinking…",
  speaking: "Speaking",
  offline: "Offline",
  busy: "Server busy",
  need_key: "Waiting for the API key",
  idle_closed: "Disconnected while idle",
};

// The per-turn figures of `turn_done.metrics`, named exactly as TurnMetrics in app/protocol.py
// (tests/web/test_web_metric_names.py checks them), in the order the tooltip lists them.
export const METRIC_LABELS = {
  voice_to_voice_ms: "voice to voice (ms)",
  endpoint_ms: "endpoint (ms)",
  asr_final_ms: "ASR final (ms)",
  asr_compute_ms: "ASR compute (ms)",
  turn_detect_ms: "turn detection (ms)",
  turn_probability: "turn complete (P)",
  turn_text_ms: "end-of-turn words (ms)",
  llm_ttft_ms: "LLM first token (ms)",
  llm_first_piece_ms: "LLM first piece (ms)",
  tts_first_audio_ms: "TTS first audio (ms)",
  tool_calls: "tool calls",
  tool_ms: "tools' own time (ms)",
  answer_ms: "voice to answer after tools (ms)",
  reply_audio_s: "reply audio (s)",
  rtf: "RTF",
  underruns: "underruns",
};

export class UI {
  constructor() {
    this.log = $("log");
    this.empty = $("empty");
    this.status = $("status");
    this.conn = $("conn");
    this.error = $("error");
    this.errorTimers = new Map();
    this.startBtn = $("start");
    this.startLabel = $("start-label");
    this.meter = $("meter");
    this.meterFill = $("meter-fill");
    this.latency = $("latency");
    this.stopBtn = $("stop");
    this.duplexBtn = $("duplex");
  }

  // ------------------------------------------------------------------ status
  setStatus(state) {
    if (this.status.dataset.state === state) return;
    this.status.dataset.state = state;
    this.status.textContent = STATUS_TEXT[state] || state;
    document.body.dataset.state = state; // lets CSS animate the mic button per state
  }

  setConnection(state, text) {
    this.conn.dataset.state = state;
    this.conn.textContent = text;
  }

  setMicActive(active) {
    this.startBtn.setAttribute("aria-pressed", String(active));
    const label = active ? "Stop talking" : "Start talking";
    this.startBtn.setAttribute("aria-label", label);
    this.startBtn.title = label;
    this.startLabel.textContent = active ? "Tap to stop" : "Tap to talk";
    this.meter.hidden = !active;
  }

  /** The Stop button works while a reply is being thought of or spoken. */
  setStoppable(stoppable) {
    const value = String(!stoppable);
    if (this.stopBtn.getAttribute("aria-disabled") !== value) this.stopBtn.setAttribute("aria-disabled", value);
  }

  /** The half-duplex switch shows what the server applied (`config_applied.half_duplex`). */
  setHalfDuplex(on) {
    this.duplexBtn.setAttribute("aria-checked", String(Boolean(on)));
  }

  setMicBusy(busy) {
    this.startBtn.disabled = busy;
  }

  /** Mic level 0..1 (RMS). Shown on a log-ish scale: speech RMS is ~0.02-0.2. */
  setLevel(rms) {
    const db = 20 * Math.log10(Math.max(rms, 1e-4)); // -80..0
    const v = Math.min(1, Math.max(0, (db + 60) / 50));
    this.meterFill.style.transform = `scaleX(${v.toFixed(3)})`;
    this.meter.setAttribute("aria-valuenow", String(Math.round(v * 100)));
    this.startBtn.style.setProperty("--level", v.toFixed(3));
  }

  /** `metrics` is a turn_done's TurnMetrics (app/protocol.py): figures a turn did not reach are absent. */
  showLatency(metrics) {
    const v2v = metrics && metrics.voice_to_voice_ms;
    if (typeof v2v !== "number") return; // a turn with no reply audio has no latency to show
    this.latency.textContent = `reply in ${Math.round(v2v)} ms`;
    this.latency.title = metricRows(metrics)
      .map(([label, value]) => `${label}: ${value}`)
      .join("\n");
    this.latency.hidden = false;
  }

  // ------------------------------------------------------------------ errors
  /**
   * Show (or replace) the error line of one `kind` ("connection", "mic", "server"), so
   * a later success clears only its own problem and one error never hides another.
   */
  showError(kind, message, { action = null, autoHideMs = 0 } = {}) {
    clearTimeout(this.errorTimers.get(kind));
    let item = this.error.querySelector(`.error-item[data-kind="${kind}"]`);
    if (!item) {
      item = document.createElement("div");
      item.className = "error-item";
      item.dataset.kind = kind;
      item.innerHTML =
        '<svg class="error-icon" viewBox="0 0 24 24" width="18" height="18" aria-hidden="true"><circle cx="12" cy="12" r="10" fill="currentColor" opacity=".15"/><path d="M12 7v6M12 16.5v.5" stroke="currentColor" stroke-width="2.2" stroke-linecap="round"/></svg>' +
        '<span class="error-text"></span><button class="error-action" type="button" hidden></button>' +
        '<button class="error-close" type="button" aria-label="Dismiss message">&times;</button>';
      item.querySelector(".error-close").addEventListener("click", () => this.clearError(kind));
      this.error.append(item);
    }
    item.querySelector(".error-text").textContent = message;
    const btn = item.querySelector(".error-action");
    btn.hidden = !action;
    btn.textContent = action ? action.label : "";
    btn.onclick = action ? action.onClick : null;
    this.error.hidden = false;
    if (autoHideMs) this.errorTimers.set(kind, setTimeout(() => this.clearError(kind), autoHideMs));
  }

  clearError(kind) {
    clearTimeout(this.errorTimers.get(kind));
    const item = this.error.querySelector(`.error-item[data-kind="${kind}"]`);
    if (item) item.remove();
    this.error.hidden = this.error.children.length === 0;
  }

  // ------------------------------------------------------------------ conversation
  _bubble(role, turn) {
    return this.log.querySelector(`.msg.${role}[data-turn="${CSS.escape(String(turn))}"]`);
  }

  _newBubble(role, turn, time = new Date().toISOString()) {
    this.empty.hidden = true;
    const el = document.createElement("article");
    el.className = `msg ${role}`;
    el.dataset.turn = String(turn);
    el.dataset.time = time;
    const who = document.createElement("h3");
    who.className = "who";
    who.textContent = role === "user" ? "You" : "Parley";
    const text = document.createElement("p");
    text.className = "text";
    el.append(who, text);
    return el;
  }

  _append(el) {
    const stick = this.log.scrollHeight - this.log.scrollTop - this.log.clientHeight < 80;
    this.log.append(el);
    if (stick) this.log.scrollTop = this.log.scrollHeight; // follow only if the user hasn't scrolled up
  }

  _follow() {
    const gap = this.log.scrollHeight - this.log.scrollTop - this.log.clientHeight;
    if (gap < 160) this.log.scrollTop = this.log.scrollHeight;
  }

  /** A typed question, shown before the server has numbered its turn. */
  addPendingUser(text) {
    const el = this._newBubble("user", "pending");
    el.querySelector(".text").textContent = text;
    el.classList.add("typed");
    this._append(el);
  }

  /** Give the oldest pending (typed) bubble its turn id once the server names it. */
  adoptPending(turn) {
    if (this._bubble("user", turn)) return;
    const el = this.log.querySelector('.msg.user[data-turn="pending"]');
    if (el) el.dataset.turn = String(turn);
  }

  /** A partial transcript of an earlier turn that never got its final one: it was never committed. */
  dropStalePartials(turn) {
    this.log.querySelectorAll(".msg.user.partial").forEach((el) => {
      if (Number(el.dataset.turn) < turn) el.remove();
    });
  }

  /** The server dropped the speech this partial transcript showed (noise, "um", a "yeah" over the reply). */
  dropPartial(turn) {
    const el = this._bubble("user", turn);
    if (el && el.classList.contains("partial")) el.remove();
  }

  /** Partial transcripts update the same bubble in place until the final one. */
  userTranscript(turn, text, final) {
    let el = this._bubble("user", turn);
    if (!el) {
      if (!text.trim()) return;
      el = this._newBubble("user", turn);
      const reply = this._bubble("assistant", turn);
      if (reply) reply.before(el); // keep question above its answer
      else this._append(el);
    }
    if (final && !text.trim()) {
      el.remove(); // a false start: nothing was said after all
      return;
    }
    el.querySelector(".text").textContent = text;
    el.classList.toggle("partial", !final);
    this._follow();
  }

  _replyBubble(turn) {
    let el = this._bubble("assistant", turn);
    if (!el) {
      el = this._newBubble("assistant", turn);
      el.classList.add("streaming");
      el.setAttribute("aria-busy", "true"); // screen readers wait for the whole reply
      this._append(el);
    }
    return el;
  }

  assistantDelta(turn, delta) {
    this._replyBubble(turn).querySelector(".text").textContent += delta;
    this._follow();
  }

  /** A function the reply calls (`tool_call`), listed in its bubble until `toolDone` says how it went. */
  toolCall(turn, call) {
    this._addTool(this._replyBubble(turn), {
      id: call.call_id,
      call: `${call.name}(${call.arguments})`,
      result: "…",
      status: "pending",
    });
    this._follow();
  }

  toolDone(done) {
    const item = this.log.querySelector(`.tool[data-call="${CSS.escape(done.call_id)}"]`);
    if (!item) return;
    item.dataset.status = done.status;
    item.querySelector(".result").textContent = done.status === "completed" ? `→ ${done.output}` : `(${done.status})`;
  }

  _addTool(el, { id = "", call, result, status }) {
    let list = el.querySelector(".tools");
    if (!list) {
      list = document.createElement("ul");
      list.className = "tools";
      list.setAttribute("aria-label", "functions called");
      el.querySelector(".text").after(list);
    }
    const item = document.createElement("li");
    item.className = "tool";
    item.dataset.call = id;
    item.dataset.status = status;
    const name = document.createElement("code");
    name.className = "call";
    name.textContent = call;
    const outcome = document.createElement("span");
    outcome.className = "result";
    outcome.textContent = result;
    item.append(name, " ", outcome);
    list.append(item);
  }

  _settle(el) {
    el.classList.remove("streaming");
    el.removeAttribute("aria-busy");
  }

  assistantDone(turn, text, interrupted, metrics) {
    let el = this._bubble("assistant", turn);
    if (!el) {
      if (!text) return;
      el = this._newBubble("assistant", turn);
      this._append(el);
    }
    if (text) el.querySelector(".text").textContent = text;
    this._settle(el);
    if (interrupted) this._markInterrupted(el);
    if (metrics && Object.keys(metrics).length) {
      el.dataset.metrics = JSON.stringify(metrics);
      this._setStages(el, metrics);
    }
    this._follow();
  }

  /** Barge-in or Stop: the reply of `turn` was cut off (turn_done may or may not follow). */
  /** The user went on with `turn`: its reply bubble goes, and its question is open again. */
  withdrawReply(turn) {
    this._bubble("assistant", turn)?.remove();
    this._bubble("user", turn)?.classList.add("partial");
  }

  assistantInterrupted(turn) {
    const el = this._bubble("assistant", turn);
    if (!el) return;
    this._settle(el);
    this._markInterrupted(el);
  }

  _meta(el) {
    let meta = el.querySelector(".meta");
    if (!meta) {
      meta = document.createElement("div");
      meta.className = "meta";
      el.append(meta);
    }
    return meta;
  }

  _markInterrupted(el) {
    el.classList.add("interrupted");
    const meta = this._meta(el);
    if (!meta.querySelector(".flag")) {
      const flag = document.createElement("span");
      flag.className = "flag";
      flag.textContent = "interrupted";
      meta.prepend(flag);
    }
  }

  /** The stage breakdown of a reply, as a disclosure: reachable by keyboard and read by screen readers. */
  _setStages(el, metrics) {
    const rows = metricRows(metrics);
    if (!rows.length) return;
    const meta = this._meta(el);
    meta.querySelector(".stages")?.remove();
    const details = document.createElement("details");
    details.className = "stages";
    const summary = document.createElement("summary");
    const v2v = metrics.voice_to_voice_ms;
    summary.textContent = typeof v2v === "number" ? `reply in ${Math.round(v2v)} ms` : "timings";
    summary.setAttribute("aria-label", `${summary.textContent}: show the time each stage took`);
    const list = document.createElement("dl");
    for (const [label, value] of rows) {
      const row = document.createElement("div");
      const dt = document.createElement("dt");
      dt.textContent = label;
      const dd = document.createElement("dd");
      dd.textContent = value;
      row.append(dt, dd);
      list.append(row);
    }
    details.append(summary, list);
    meta.append(details);
  }

  /** A new server session numbers turns afresh: retag the old bubbles so ids can't collide. */
  archiveTurns(session) {
    this.log.querySelectorAll(".msg").forEach((el) => {
      const t = el.dataset.turn;
      if (!t.includes(":")) el.dataset.turn = `s${session}:${t}`;
      el.classList.remove("partial");
      this._settle(el);
    });
  }

  /** A line in the conversation; `keep`: part of the saved transcript (server notices). */
  notice(text, { keep = false, kind = "info", time = new Date().toISOString() } = {}) {
    this.empty.hidden = true;
    const el = document.createElement("p");
    el.className = `notice ${kind}`;
    el.textContent = text;
    el.dataset.time = time;
    if (keep) el.dataset.keep = "1";
    this._append(el);
    return el;
  }

  /** What the conversation holds, oldest first: what is saved, exported and restored. */
  entries() {
    const out = [];
    this.log.querySelectorAll(".msg, .notice[data-keep]").forEach((el) => {
      if (el.classList.contains("partial")) return; // not yet said
      const text = (el.querySelector(".text")?.textContent ?? el.textContent).trim();
      if (el.classList.contains("notice")) {
        out.push({ role: "notice", text, time: el.dataset.time || null });
        return;
      }
      if (!text) return;
      const entry = { role: el.classList.contains("user") ? "user" : "assistant", text, time: el.dataset.time || null };
      if (el.classList.contains("interrupted")) entry.interrupted = true;
      const tools = [...el.querySelectorAll(".tool")].map((t) => ({
        call: t.querySelector(".call").textContent,
        result: t.querySelector(".result").textContent,
        status: t.dataset.status,
      }));
      if (tools.length) entry.tools = tools;
      if (el.classList.contains("streaming")) entry.incomplete = true;
      if (el.dataset.metrics) {
        try {
          entry.metrics = JSON.parse(el.dataset.metrics);
        } catch {
          /* not recorded */
        }
      }
      out.push(entry);
    });
    return out;
  }

  /** Show a saved conversation (from an earlier page load); its turns are not the server's any more. */
  restore(entries) {
    entries.forEach((entry, i) => {
      if (!entry || typeof entry.text !== "string") return;
      if (entry.role === "notice") {
        this.notice(entry.text, { keep: true, kind: "server", time: entry.time || undefined });
        return;
      }
      if (entry.role !== "user" && entry.role !== "assistant") return;
      const el = this._newBubble(entry.role, `r:${i}`, entry.time || new Date().toISOString());
      el.querySelector(".text").textContent = entry.text;
      this.log.append(el);
      if (Array.isArray(entry.tools)) {
        entry.tools.forEach((t) => t && typeof t.call === "string" && this._addTool(el, { ...t, result: String(t.result ?? "") }));
      }
      if (entry.interrupted) this._markInterrupted(el);
      if (entry.metrics && typeof entry.metrics === "object") {
        el.dataset.metrics = JSON.stringify(entry.metrics);
        this._setStages(el, entry.metrics);
      }
    });
    this.log.scrollTop = this.log.scrollHeight;
  }

  get isEmpty() {
    return !this.log.querySelector(".msg, .notice");
  }

  clearLog() {
    this.log.querySelectorAll(".msg, .notice").forEach((el) => el.remove());
    this.empty.hidden = false;
    this.latency.hidden = true;
  }
}

/** [label, shown value] of each figure a turn has, in METRIC_LABELS order. */
export function metricRows(metrics) {
  const rows = [];
  if (!metrics) return rows;
  for (const [name, label] of Object.entries(METRIC_LABELS)) {
    const v = metrics[name];
    if (typeof v === "number" && Number.isFinite(v)) {
      rows.push([label, Number.isInteger(v) || v >= 10 ? String(Math.round(v)) : v.toFixed(2)]);
    }
  }
  return rows;
}
