// Parley page controller: wires the socket, the microphone, the player, the dialogs and the UI.

import { KeyDialog, SettingsDialog } from "./dialogs.js";
import { Mic, MicError } from "./mic.js";
import { Player } from "./player.js";
import { ParleySocket, socketUrl } from "./socket.js";
import { KEYS, apiKey, readJSON, writeJSON } from "./store.js";
import { asJSON, asText, download, exportName, keepTranscript, loadTranscript } from "./transcript.js";
import { UI } from "./ui.js";

const PLAYBACK_REPORT_MS = 250; // how often the server hears how much reply audio played
const SOFT_THINKING_MS = 4000; // speech_stopped with no transcript after this: a false start
const HARD_THINKING_MS = 60000; // give up on a reply that never finishes
const CONFIG_FIELDS = ["system_prompt", "voice", "language", "barge_in", "half_duplex"];

const ui = new UI();
const player = new Player();
const state = {
  micOn: false,
  micStarting: false,
  startSent: false, // `start` went out on the current socket: audio may follow
  ptt: false, // the mic was started by holding Space (and stops when it is released)
  pttHeld: false,
  userSpeaking: false,
  thinkingUntil: 0, // status shows "thinking" until this time (or turn_done)
  staleTurns: new Set(), // turns from before "New conversation": ignore their late events
  stoppedTurns: new Set(), // replies the user stopped: their late audio stays silent
  seenTurns: new Set(),
  replyTurn: null, // the turn whose reply is being produced or played
  session: 0, // bumps on every (re)connect; turn ids restart with a new server session
  configSent: false, // this connection got our settings
  defaultsPending: false, // the next config_applied holds the server's defaults
  userApplied: false, // the next config_applied answers the settings form
  applied: null, // the last config_applied
  lastReport: { turn: null, ms: -1 },
  lastMetrics: null,
  outputRate: null,
  voices: [],
  languages: [],
  events: [], // recent server events, for debugging and tests
  status: "connecting",
};
// What the user chose: config fields (sent on every connection) and the microphone.
const prefs = readJSON(KEYS.settings, {}) || {};

const mic = new Mic(
  (pcm) => {
    if (!state.micOn || !state.startSent) return;
    // Half-duplex: the speakers would feed the reply back into the mic; don't send it.
    if (state.applied && state.applied.half_duplex && player.playing) return;
    socket.sendAudio(pcm);
  },
  (level) => ui.setLevel(level),
);
mic.onEnded = () => {
  stopMic();
  ui.showError("mic", "The microphone stopped (unplugged or access revoked). Press the mic button to try again.");
};

// ------------------------------------------------------------------ connection
const keyDialog = new KeyDialog(
  (key) => {
    apiKey.set(key);
    ui.clearError("connection");
    socket.retryNow();
  },
  () => {
    if (socket.state === "need_key") {
      ui.showError("connection", "This server needs an API key to talk.", {
        action: { label: "Enter key", onClick: () => keyDialog.open() },
      });
    }
  },
);

const socket = new ParleySocket(
  socketUrl(),
  {
    onOpen() {
      state.startSent = false;
      state.configSent = false;
      ui.clearError("connection");
      if (state.session > 0) ui.notice("Reconnected. The server starts a fresh conversation.");
      state.session++;
      if (state.micOn) sendStart();
    },
    onState(s, info) {
      showState(s, info);
      state.status = computeStatus(); // now, not at the next tick: the two lines must agree
      ui.setStatus(state.status);
    },
    onEvent: handleEvent,
    onAudio(buf) {
      player.push(buf);
    },
  },
  { getKey: () => apiKey.get() },
);

/** What the connection state means for the page: the pill, the banner, the key dialog. */
function showState(s, info) {
  if (s === "open") {
    ui.setConnection("open", "Connected");
    return;
  }
  if (s === "checking") return;
  // The server session is gone: its turns, speech state and audio go with it.
  state.startSent = false;
  state.userSpeaking = false;
  state.thinkingUntil = 0;
  state.replyTurn = null;
  state.stoppedTurns.clear();
  player.interrupt();
  ui.archiveTurns(state.session);
  state.seenTurns.clear();
  if (s === "connecting") ui.setConnection("connecting", "Connecting…");
  else if (s === "reconnecting") {
    if (info.delay === undefined) return; // a retry is dialing; the last message still holds
    ui.setConnection("reconnecting", `Reconnecting in ${Math.max(1, Math.ceil(info.delay / 1000))} s`);
    const msg = info.wasOpen
      ? `Lost the connection to the Parley server. Reconnecting (attempt ${info.attempt})…`
      : info.reachable
        ? `The Parley server answers but refused the voice connection at ${socket.url} (is the page opened through an address the server does not allow?). Retrying (attempt ${info.attempt})…`
        : `Can't reach the Parley server at ${socket.url}. Is it running? Retrying (attempt ${info.attempt})…`;
    ui.showError("connection", msg, { action: { label: "Retry now", onClick: () => socket.retryNow() } });
  } else if (s === "busy") {
    ui.clearError("server"); // the `overloaded` error is shown as this countdown instead
    showBusy();
  } else if (s === "need_key") {
    ui.setConnection("offline", "Key needed");
    ui.clearError("connection");
    keyDialog.open({ refused: info.reason === "refused" });
    if (info.reason === "refused") apiKey.set(null);
  } else if (s === "idle_closed") {
    if (state.micOn) stopMic();
    ui.setConnection("offline", "Disconnected");
    ui.showError("connection", "Closed after being idle. Reconnect when you want to talk again.", {
      action: { label: "Reconnect", onClick: () => socket.retryNow() },
    });
  } else if (s === "closed") {
    ui.setConnection("offline", "Offline");
    if (info.reason) ui.showError("connection", info.reason);
  }
}

/** "Server busy, retrying in N s": refreshed every tick while the countdown runs. */
function showBusy() {
  const left = socket.secondsToRetry();
  const text = left > 0 ? `Server busy, retrying in ${left} s` : "Server busy, retrying…";
  ui.setConnection("reconnecting", left > 0 ? `Retry in ${left} s` : "Retrying…");
  ui.showError("connection", text, { action: { label: "Retry now", onClick: () => socket.retryNow() } });
}

function sendStart() {
  state.startSent = socket.send({ type: "start", sample_rate: mic.rate });
}

/** The stored settings the server can take (a voice or language it no longer has is left out). */
function storedConfig() {
  const out = {};
  for (const name of CONFIG_FIELDS) if (prefs[name] !== undefined && prefs[name] !== null) out[name] = prefs[name];
  if (out.voice !== undefined && !state.voices.includes(out.voice)) delete out.voice;
  if (out.language !== undefined && !state.languages.includes(out.language)) delete out.language;
  if (typeof out.system_prompt === "string" && !out.system_prompt.trim()) delete out.system_prompt;
  return out;
}

function sendConfig(fields) {
  return socket.send({ type: "config", ...fields });
}

// ------------------------------------------------------------------ server events
function handleEvent(msg) {
  state.events.push(msg);
  if (state.events.length > 300) state.events.shift();
  const turn = msg.turn_id;
  if (turn !== undefined && turn !== null) {
    if (state.staleTurns.has(turn)) return;
    if (!state.seenTurns.has(turn)) {
      state.seenTurns.add(turn);
      ui.adoptPending(turn); // a typed question gets its turn id from the first event
      ui.dropStalePartials(turn);
    }
  }
  switch (msg.type) {
    case "ready":
      state.outputRate = msg.output_sample_rate;
      state.voices = Array.isArray(msg.voices) ? msg.voices : [];
      state.languages = Array.isArray(msg.languages) ? msg.languages : [];
      settings.setChoices(state.voices, state.languages);
      if (!state.configSent) {
        // First the server's defaults (an empty config changes nothing), then our settings.
        state.configSent = true;
        state.defaultsPending = sendConfig({});
        const mine = storedConfig();
        if (Object.keys(mine).length) sendConfig(mine);
      }
      break;
    case "config_applied":
      if (state.defaultsPending) {
        state.defaultsPending = false;
        settings.setDefaults(msg);
      }
      state.applied = msg;
      settings.show(msg);
      ui.setHalfDuplex(msg.half_duplex);
      if (state.userApplied) {
        state.userApplied = false;
        settings.setStatus("Applied by the server.", "ok");
        ui.notice(describeSettings(msg));
      }
      break;
    case "speech_started":
      state.userSpeaking = true;
      state.staleTurns.clear();
      break;
    case "speech_stopped":
      state.userSpeaking = false;
      state.thinkingUntil = Date.now() + SOFT_THINKING_MS;
      break;
    case "speech_dropped":
      // Not a turn (noise, "um", a "yeah" over the reply): nothing will answer it. A continued turn's
      // words come again as its final transcript.
      state.userSpeaking = false;
      ui.dropPartial(turn);
      if (state.replyTurn === null) state.thinkingUntil = 0;
      break;
    case "transcript":
      ui.userTranscript(turn, msg.text, msg.final);
      if (msg.final && msg.text.trim()) {
        state.thinkingUntil = Date.now() + HARD_THINKING_MS;
        state.replyTurn = turn;
      }
      break;
    case "assistant_text":
      if (state.stoppedTurns.has(turn)) break; // the user stopped it; its tail is not shown
      ui.assistantDelta(turn, msg.delta);
      state.replyTurn = turn;
      state.thinkingUntil = Date.now() + HARD_THINKING_MS;
      break;
    case "tool_call":
      if (state.stoppedTurns.has(turn)) break;
      ui.toolCall(turn, msg);
      state.replyTurn = turn;
      state.thinkingUntil = Date.now() + HARD_THINKING_MS;
      break;
    case "tool_done":
      ui.toolDone(msg);
      break;
    case "audio_start":
      player.begin(turn, msg.sample_rate);
      if (state.stoppedTurns.has(turn)) player.interrupt(turn); // stopped before its audio came
      else state.replyTurn = turn;
      break;
    case "interrupt":
      // Barge-in (or our cancel): cut the audio now, then tell the server how much was heard.
      report(turn, player.interrupt(turn), true);
      ui.assistantInterrupted(turn);
      break;
    case "turn_continued":
      // The user went on with this turn after a pause: its reply is withdrawn (stop it, drop its
      // text) and the whole turn is answered next, under the same turn id.
      player.interrupt(turn);
      ui.withdrawReply(turn);
      break;
    case "turn_done":
      ui.assistantDone(turn, msg.text, msg.interrupted, msg.metrics);
      if (msg.metrics && Object.keys(msg.metrics).length) {
        state.lastMetrics = msg.metrics;
        ui.showLatency(msg.metrics);
      }
      if (state.replyTurn === turn) state.replyTurn = null;
      state.thinkingUntil = 0;
      break;
    case "notice":
      // Not an error: something the user should know ("your message was cut to fit").
      ui.notice(msg.message, { keep: true, kind: "server" });
      break;
    case "error":
      if (msg.turn_id != null) {
        // the error ended that turn (turn_failed, llm_unavailable): no turn_done follows
        if (state.replyTurn === msg.turn_id) state.replyTurn = null;
        state.thinkingUntil = 0;
      }
      if (msg.code === "overloaded") break; // shown as the "Server busy" countdown
      if (msg.code === "bad_config") {
        settings.setStatus(`Not applied: ${msg.message}`, "error");
        state.userApplied = false;
      }
      ui.showError("server", `Server error (${msg.code}): ${msg.message}`, { autoHideMs: msg.fatal ? 0 : 12000 });
      break;
    default:
      console.debug("unhandled event", msg);
  }
}

function describeSettings(applied) {
  const parts = [`voice ${applied.voice}`, `language ${applied.language || "auto"}`];
  parts.push(`barge-in ${applied.barge_in ? "on" : "off"}`, `half-duplex ${applied.half_duplex ? "on" : "off"}`);
  const custom = settings.defaults && applied.system_prompt !== settings.defaults.system_prompt;
  parts.push(custom ? "your system prompt" : "the default system prompt");
  return `Settings applied: ${parts.join(", ")}.`;
}

function report(turn, ms, force = false) {
  const played = Math.round(ms);
  if (!force && state.lastReport.turn === turn && state.lastReport.ms === played) return;
  if (socket.send({ type: "playback", turn_id: turn, played_ms: played })) state.lastReport = { turn, ms: played };
}

// While a reply plays, report progress so a barge-in can truncate the history at
// what the user actually heard; one more report after it finishes carries the total.
setInterval(() => {
  // report() skips unchanged values, so this goes quiet once the audio has finished.
  if (player.turnId === null || player.dropped.has(player.turnId)) return;
  report(player.turnId, player.playedMs());
}, PLAYBACK_REPORT_MS);

// ------------------------------------------------------------------ status line
function computeStatus() {
  if (!socket.isOpen) {
    const s = socket.state;
    if (s === "reconnecting" || s === "busy" || s === "need_key" || s === "idle_closed") return s;
    return s === "closed" ? "offline" : "connecting";
  }
  if (state.micStarting) return "starting";
  if (state.userSpeaking) return "user_speaking";
  if (player.playing) return "speaking";
  if (Date.now() < state.thinkingUntil) return "thinking";
  return state.micOn ? "listening" : "ready";
}

let wasPlaying = false;
setInterval(() => {
  // The moment a reply finishes playing, report its full length (don't wait for the 250 ms tick).
  const playing = player.playing;
  if (wasPlaying && !playing && player.turnId !== null && !player.dropped.has(player.turnId)) {
    report(player.turnId, player.playedMs());
  }
  wasPlaying = playing;
  state.status = computeStatus();
  ui.setStatus(state.status);
  ui.setStoppable(state.status === "speaking" || state.status === "thinking");
  if (socket.state === "reconnecting") {
    const left = socket.secondsToRetry();
    ui.setConnection("reconnecting", left > 0 ? `Reconnecting in ${left} s` : "Reconnecting…");
  } else if (socket.state === "busy") {
    showBusy();
  }
  wakeLock.want(state.micOn || playing || state.status === "thinking");
}, 100);

// ------------------------------------------------------------------ screen wake lock
// A phone must not lock its screen mid-conversation (that would stop the mic and audio).
const wakeLock = {
  sentinel: null,
  pending: false,
  want(on) {
    if (!("wakeLock" in navigator)) return;
    if (on && !this.sentinel && !this.pending && document.visibilityState === "visible") {
      this.pending = true;
      navigator.wakeLock
        .request("screen")
        .then((sentinel) => {
          this.sentinel = sentinel;
          sentinel.addEventListener("release", () => {
            if (this.sentinel === sentinel) this.sentinel = null; // the page was hidden: ask again when shown
          });
        })
        .catch(() => {}) // refused (battery saver, no gesture yet): not worth an error
        .finally(() => {
          this.pending = false;
        });
    } else if (!on && this.sentinel) {
      const sentinel = this.sentinel;
      this.sentinel = null;
      sentinel.release().catch(() => {});
    }
  },
};

// ------------------------------------------------------------------ controls
async function startMic() {
  player.unlock(); // inside the click or key press: browsers only allow audio output after a gesture
  state.micStarting = true;
  ui.setMicBusy(true);
  ui.setStatus("starting");
  try {
    await mic.start(prefs.mic || "");
    state.micOn = true;
    ui.clearError("mic");
    ui.setMicActive(true);
    if (mic.fellBack) {
      ui.showError("mic", "The chosen microphone is not available; using the system default.", { autoHideMs: 8000 });
    }
    if (socket.isOpen) sendStart();
  } catch (err) {
    const message = err instanceof MicError ? err.message : `The microphone could not be started: ${err}`;
    ui.showError("mic", message);
    ui.setMicActive(false);
    state.ptt = false;
  } finally {
    state.micStarting = false;
    ui.setMicBusy(false);
  }
  if (state.micOn && state.ptt && !state.pttHeld) stopMic(); // Space was released while it started
}

async function stopMic() {
  // Pressing stop means "I'm done": a second of silence lets the server's VAD end an
  // utterance that was cut off mid-word instead of leaving it open.
  if (state.micOn && state.startSent) {
    const silence = new ArrayBuffer((mic.rate / 50) * 2);
    for (let i = 0; i < 50; i++) socket.sendAudio(silence);
  }
  state.micOn = false;
  state.ptt = false;
  state.userSpeaking = false;
  ui.setMicActive(false);
  await mic.stop();
}

/** Stop the reply now: silence it here at once, and ask the server to stop it (`cancel`). */
function stopReply() {
  const playing = player.playing;
  const turn = state.replyTurn ?? (playing ? player.turnId : null);
  if (turn === null && !playing && Date.now() >= state.thinkingUntil) return false; // nothing to stop
  if (turn !== null) {
    state.stoppedTurns.add(turn);
    // Say how much was heard first, so the server's history keeps exactly that.
    if (player.turnId === turn && !player.dropped.has(turn)) report(turn, player.interrupt(turn), true);
    ui.assistantInterrupted(turn);
  }
  player.interrupt();
  socket.send({ type: "cancel" });
  state.thinkingUntil = 0;
  state.replyTurn = null;
  return true;
}

document.getElementById("start").addEventListener("click", () => {
  state.ptt = false;
  return state.micOn ? stopMic() : startMic();
});

document.getElementById("stop").addEventListener("click", () => {
  if (ui.stopBtn.getAttribute("aria-disabled") !== "true") stopReply();
});

document.getElementById("duplex").addEventListener("click", () => {
  const on = !(state.applied ? state.applied.half_duplex : prefs.half_duplex);
  savePrefs({ half_duplex: on });
  ui.setHalfDuplex(on);
  sendConfig({ half_duplex: on });
});

document.getElementById("reset").addEventListener("click", () => {
  socket.send({ type: "reset" });
  player.interrupt();
  for (const t of state.seenTurns) state.staleTurns.add(t);
  state.thinkingUntil = 0;
  state.replyTurn = null;
  ui.clearLog();
});

const form = document.getElementById("text-form");
const input = document.getElementById("text");
form.addEventListener("submit", (e) => {
  e.preventDefault();
  const text = input.value.trim();
  if (!text) return;
  player.unlock();
  if (!socket.send({ type: "text", text })) {
    ui.showError("connection", "Not connected to the server yet; your message was not sent.", { autoHideMs: 6000 });
    return;
  }
  state.staleTurns.clear();
  ui.addPendingUser(text);
  input.value = "";
  state.thinkingUntil = Date.now() + HARD_THINKING_MS;
});

// ------------------------------------------------------------------ settings
function savePrefs(changes) {
  Object.assign(prefs, changes);
  writeJSON(KEYS.settings, prefs);
}

const settings = new SettingsDialog({
  listMics: () => Mic.devices(),
  async onApply(fields, micId) {
    const defaults = settings.defaults;
    // A prompt equal to the server's default is not remembered: a new default then applies.
    const stored = { ...fields };
    if (defaults && stored.system_prompt === defaults.system_prompt) stored.system_prompt = null;
    const micChanged = (prefs.mic || "") !== micId;
    savePrefs({ ...stored, mic: micId });
    settings.setMic(micId);
    if (micChanged && state.micOn) {
      await stopMic();
      await startMic();
    }
    state.userApplied = sendConfig(fields);
    settings.setStatus(
      state.userApplied ? "Applying…" : "Saved. It will be applied when the page is connected.",
      state.userApplied ? "info" : "warn",
    );
  },
});
settings.setMic(prefs.mic || "");
ui.setHalfDuplex(Boolean(prefs.half_duplex));

// ------------------------------------------------------------------ export
const exportMenu = document.getElementById("export-menu");
function exportAs(kind) {
  const entries = ui.entries();
  exportMenu.open = false;
  if (kind === "json") download(exportName("json"), asJSON(entries), "application/json");
  else download(exportName("txt"), asText(entries), "text/plain;charset=utf-8");
}
document.getElementById("export-txt").addEventListener("click", () => exportAs("txt"));
document.getElementById("export-json").addEventListener("click", () => exportAs("json"));
document.addEventListener("click", (e) => {
  if (exportMenu.open && !exportMenu.contains(e.target)) exportMenu.open = false;
});

// ------------------------------------------------------------------ keyboard
// Hold Space to talk (push-to-talk), Esc to stop the reply. Neither acts while the user
// types or works a control (Space presses buttons, Esc closes dialogs and menus).
function isBusyTarget(target) {
  return target instanceof Element && target.closest("input, textarea, select, button, summary, a, [contenteditable], dialog, [role=switch]");
}

document.addEventListener("keydown", (e) => {
  if (e.key === "Escape") {
    if (keyDialog.isOpen || settings.isOpen) return;
    if (exportMenu.open) {
      exportMenu.open = false;
      exportMenu.querySelector("summary").focus();
      return;
    }
    if (stopReply()) e.preventDefault();
    return;
  }
  if (e.code !== "Space" || e.ctrlKey || e.metaKey || e.altKey || isBusyTarget(e.target)) return;
  e.preventDefault(); // no page scroll
  if (e.repeat || state.micOn || state.micStarting) return;
  state.ptt = true;
  state.pttHeld = true;
  startMic();
});

function releasePtt() {
  if (!state.pttHeld) return;
  state.pttHeld = false;
  if (state.ptt && state.micOn) stopMic(); // still starting: startMic() stops it when done
}
document.addEventListener("keyup", (e) => {
  if (e.code === "Space" && state.pttHeld) {
    e.preventDefault();
    releasePtt();
  }
});
window.addEventListener("blur", releasePtt); // the key-up goes elsewhere when the window loses focus

// ------------------------------------------------------------------ transcript across reloads
const saved = loadTranscript();
if (saved.length) {
  ui.restore(saved);
  ui.notice("Earlier messages, kept in this browser. Parley starts this conversation afresh.", { kind: "divider" });
}
keepTranscript(ui.log, () => ui.entries());

// ------------------------------------------------------------------ test hooks
window.parley = {
  get playedSamples() {
    return player.playedSamples;
  },
  get receivedSamples() {
    return player.receivedSamples;
  },
  get underruns() {
    return player.underruns;
  },
  get playing() {
    return player.playing;
  },
  get state() {
    return state.status;
  },
  get thinking() {
    return Date.now() < state.thinkingUntil;
  },
  get socketState() {
    return socket.state;
  },
  get micOn() {
    return state.micOn;
  },
  get lastMetrics() {
    return state.lastMetrics;
  },
  get applied() {
    return state.applied;
  },
  get micDevice() {
    return mic.deviceId;
  },
  get events() {
    return state.events.slice();
  },
  sendText(text) {
    input.value = text;
    form.requestSubmit();
  },
};

ui.setMicActive(false);
socket.start();
