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
};

// The per-turn figures of `turn_done.metrics`, named exactly as TurnMetrics in app/protocol.py
// (tests/clients/test_web_metric_names.py checks them), in the order the tooltip lists them.
export const METRIC_LABELS = {
  voice_to_voice_ms: "voice to voice (ms)",
  endpoint_ms: "endpoint (ms)",
  asr_final_ms: "ASR final (ms)",
  asr_compute_ms: "ASR compute (ms)",
  llm_ttft_ms: "LLM first token (ms)",
  tts_first_audio_ms: "TTS first audio (ms)",
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
    const parts = [];
    for (const [name, label] of Object.entries(METRIC_LABELS)) {
      const v = metrics[name];
      if (typeof v === "number") parts.push(`${label}: ${Number.isInteger(v) || v >= 10 ? Math.round(v) : v.toFixed(2)}`);
    }
    this.latency.textContent = `reply in ${Math.round(v2v)} ms`;
    this.latency.title = parts.join("\n");
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

  _newBubble(role, turn) {
    this.empty.hidden = true;
    const el = document.createElement("div");
    el.className = `msg ${role}`;
    el.dataset.turn = String(turn);
    const who = document.createElement("span");
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

  assistantDelta(turn, delta) {
    let el = this._bubble("assistant", turn);
    if (!el) {
      el = this._newBubble("assistant", turn);
      el.classList.add("streaming");
      this._append(el);
    }
    el.querySelector(".text").textContent += delta;
    this._follow();
  }

  assistantDone(turn, text, interrupted, metrics) {
    let el = this._bubble("assistant", turn);
    if (!el) {
      if (!text) return;
      el = this._newBubble("assistant", turn);
      this._append(el);
    }
    if (text) el.querySelector(".text").textContent = text;
    el.classList.remove("streaming");
    const v2v = metrics && metrics.voice_to_voice_ms;
    const parts = [];
    if (interrupted) parts.push("interrupted");
    if (typeof v2v === "number") parts.push(`reply in ${Math.round(v2v)} ms`);
    this._setMeta(el, parts.join(" · "));
    this._follow();
  }

  /** Barge-in: the reply of `turn` was cut off (turn_done may or may not follow). */
  assistantInterrupted(turn) {
    const el = this._bubble("assistant", turn);
    if (!el) return;
    el.classList.remove("streaming");
    el.classList.add("interrupted");
    if (!el.querySelector(".meta")) this._setMeta(el, "interrupted");
  }

  _setMeta(el, text) {
    let meta = el.querySelector(".meta");
    if (!text) return;
    if (!meta) {
      meta = document.createElement("span");
      meta.className = "meta";
      el.append(meta);
    }
    meta.textContent = text;
    if (text.startsWith("interrupted")) el.classList.add("interrupted");
  }

  /** A new server session numbers turns afresh: retag the old bubbles so ids can't collide. */
  archiveTurns(session) {
    this.log.querySelectorAll(".msg").forEach((el) => {
      const t = el.dataset.turn;
      if (!t.includes(":")) el.dataset.turn = `s${session}:${t}`;
      el.classList.remove("partial", "streaming");
    });
  }

  notice(text) {
    this.empty.hidden = true;
    const el = document.createElement("div");
    el.className = "notice";
    el.textContent = text;
    this._append(el);
  }

  clearLog() {
    this.log.querySelectorAll(".msg, .notice").forEach((el) => el.remove());
    this.empty.hidden = false;
    this.latency.hidden = true;
  }
}
