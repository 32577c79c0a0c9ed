// Parley page controller: wires the socket, the microphone, the player and the UI.

import { Mic, MicError } from "./mic.js";
import { Player } from "./player.js";
import { ParleySocket, defaultSocketUrl } from "./socket.js";
import { UI } from "./ui.js";

const PLAYBACK_REPORT_MS = 250; // how often the server hears how much reply audio played
const SOFT_THINKING_MS = 4000; // speech_stopped with no transcript after this: a false start
const HARD_THINKING_MS = 60000; // give up on a reply that never finishes

const ui = new UI();
const player = new Player();
const state = {
  micOn: false,
  micStarting: false,
  startSent: false, // `start` went out on the current socket: audio may follow
  userSpeaking: false,
  thinkingUntil: 0, // status shows "thinking" until this time (or turn_done)
  staleTurns: new Set(), // turns from before "New conversation": ignore their late events
  seenTurns: new Set(),
  session: 0, // bumps on every (re)connect; turn ids restart with a new server session
  lastReport: { turn: null, ms: -1 },
  lastMetrics: null,
  outputRate: null,
  events: [], // recent server events, for debugging and tests
  status: "connecting",
};

const mic = new Mic(
  (pcm) => {
    if (state.micOn && state.startSent) socket.sendAudio(pcm);
  },
  (level) => ui.setLevel(level),
);
mic.onEnded = () => {
  stopMic();
  ui.showError("mic", "The microphone stopped (unplugged or access revoked). Press the mic button to try again.");
};

const socket = new ParleySocket(defaultSocketUrl(), {
  onOpen() {
    state.startSent = false;
    ui.clearError("connection");
    if (state.session > 0) ui.notice("Reconnected. The server starts a fresh conversation.");
    state.session++;
    if (state.micOn) sendStart();
  },
  onState(s, info) {
    if (s === "open") {
      ui.setConnection("open", "Connected");
      return;
    }
    // The server session is gone: its turns, speech state and audio go with it.
    state.startSent = false;
    state.userSpeaking = false;
    state.thinkingUntil = 0;
    player.interrupt();
    ui.archiveTurns(state.session);
    state.seenTurns.clear();
    if (s === "connecting") ui.setConnection("connecting", "Connecting…");
    else if (s === "reconnecting") {
      if (info.delay === undefined) return; // a retry is dialing; the last message still holds
      ui.setConnection("reconnecting", `Reconnecting in ${Math.max(1, Math.ceil(info.delay / 1000))} s`);
      const msg = info.wasOpen
        ? `Lost the connection to the Parley server. Reconnecting (attempt ${info.attempt})…`
        : `Can't reach the Parley server at ${socket.url}. Is it running? Retrying (attempt ${info.attempt})…`;
      ui.showError("connection", msg, { action: { label: "Retry now", onClick: () => socket.retryNow() } });
    } else if (s === "closed") {
      ui.setConnection("offline", "Offline");
      if (info.reason) ui.showError("connection", info.reason);
    }
  },
  onEvent: handleEvent,
  onAudio(buf) {
    player.push(buf);
  },
});

function sendStart() {
  state.startSent = socket.send({ type: "start", sample_rate: mic.rate });
}

// ------------------------------------------------------------------ server events
function handleEvent(msg) {
  state.events.push(msg);
  if (state.events.length > 300) state.events.shift();
  const turn = msg.turn_id;
  if (turn !== undefined) {
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
      break;
    case "speech_started":
      state.userSpeaking = true;
      state.staleTurns.clear();
      break;
    case "speech_stopped":
      state.userSpeaking = false;
      state.thinkingUntil = Date.now() + SOFT_THINKING_MS;
      break;
    case "transcript":
      ui.userTranscript(turn, msg.text, msg.final);
      if (msg.final && msg.text.trim()) state.thinkingUntil = Date.now() + HARD_THINKING_MS;
      break;
    case "assistant_text":
      ui.assistantDelta(turn, msg.delta);
      state.thinkingUntil = Date.now() + HARD_THINKING_MS;
      break;
    case "audio_start":
      player.begin(turn, msg.sample_rate);
      break;
    case "interrupt":
      // Barge-in: cut the audio now, then tell the server how much was heard.
      report(turn, player.interrupt(turn), true);
      ui.assistantInterrupted(turn);
      break;
    case "turn_done":
      ui.assistantDone(turn, msg.text, msg.interrupted, msg.metrics);
      if (msg.metrics && Object.keys(msg.metrics).length) {
        state.lastMetrics = msg.metrics;
        ui.showLatency(msg.metrics);
      }
      state.thinkingUntil = 0;
      break;
    case "error":
      ui.showError("server", `Server error (${msg.code}): ${msg.message}`, { autoHideMs: msg.fatal ? 0 : 12000 });
      break;
    default:
      console.debug("unhandled event", msg);
  }
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
  if (!socket.isOpen) return socket.state === "reconnecting" ? "reconnecting" : socket.state === "closed" ? "offline" : "connecting";
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
  if (socket.state === "reconnecting") {
    const left = Math.ceil((socket.retryAt - Date.now()) / 1000);
    ui.setConnection("reconnecting", left > 0 ? `Reconnecting in ${left} s` : "Reconnecting…");
  }
}, 100);

// ------------------------------------------------------------------ controls
async function startMic() {
  player.unlock(); // inside the click: browsers only allow audio output after a gesture
  state.micStarting = true;
  ui.setMicBusy(true);
  ui.setStatus("starting");
  try {
    await mic.start();
    state.micOn = true;
    ui.clearError("mic");
    ui.setMicActive(true);
    if (socket.isOpen) sendStart();
  } catch (err) {
    const message = err instanceof MicError ? err.message : `The microphone could not be started: ${err}`;
    ui.showError("mic", message);
    ui.setMicActive(false);
  } finally {
    state.micStarting = false;
    ui.setMicBusy(false);
  }
}

async function stopMic() {
  // Pressing stop means "I'm done": a second of silence lets the server's VAD end an
  // utterance that was cut off mid-word instead of leaving it open.
  if (state.micOn && state.startSent) {
    const silence = new ArrayBuffer((mic.rate / 50) * 2);
    for (let i = 0; i < 50; i++) socket.sendAudio(silence);
  }
  state.micOn = false;
  state.userSpeaking = false;
  ui.setMicActive(false);
  await mic.stop();
}

document.getElementById("start").addEventListener("click", () => (state.micOn ? stopMic() : startMic()));

document.getElementById("reset").addEventListener("click", () => {
  socket.send({ type: "reset" });
  player.interrupt();
  for (const t of state.seenTurns) state.staleTurns.add(t);
  state.thinkingUntil = 0;
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
  get state() {
    return state.status;
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
  get events() {
    return state.events.slice();
  },
  sendText(text) {
    input.value = text;
    form.requestSubmit();
  },
};

ui.setMicActive(false);
socket.connect();
