// The WebSocket to the server (/ws), with reconnects that follow what the server said.
//
// Wire protocol (app/protocol.py is the source of truth): text frames are JSON events,
// binary frames are PCM16 LE audio (mic -> server, reply audio -> page).
//
// The page only ever talks to its own origin: there is no way to point it at another
// server (a link that did so could send the user's microphone elsewhere).
//
// Why the connection closed decides what happens next:
//   * the upgrade failed (a browser reports no detail, code 1006): ask /healthz. When the
//     server wants an API key, ask the user for one (again, if the one we offered was
//     refused); otherwise the server is down: retry with backoff;
//   * 1013 after an `overloaded` error: retry after the server's `retry_after_s`, counting down;
//   * 4000 (idle): stay closed until the user asks to reconnect;
//   * anything else (a drop, 4001, a restart): retry with backoff.

const BACKOFF_MS = [500, 1000, 2000, 4000, 8000]; // then stays at the last value
const OVERLOADED_DEFAULT_S = 5;
export const CLOSE_OVERLOADED = 1013;
export const CLOSE_IDLE = 4000;
export const CLOSE_NOT_READING = 4001;
export const PROTOCOL = "parley";
export const KEY_PREFIX = "parley.key.";
// A subprotocol must be an HTTP token; a key with other characters goes in `?key=` instead.
const TOKEN = /^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$/;

/** ws:// or wss:// to /ws on the page's own origin: the only server this page talks to. */
export function socketUrl() {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  return `${scheme}//${location.host}/ws`;
}

/** The server's /healthz as JSON (it answers 503 with a body while its LLM is down), or null. */
export async function fetchHealth() {
  try {
    const response = await fetch("/healthz", { cache: "no-store", credentials: "same-origin" });
    const type = response.headers.get("content-type") || "";
    if (!type.includes("json")) return null;
    const body = await response.json();
    return body && typeof body === "object" ? body : null;
  } catch {
    return null;
  }
}

export class ParleySocket {
  /**
   * @param {string} url
   * @param {{onEvent: (msg: object) => void, onAudio: (buf: ArrayBuffer) => void,
   *          onOpen: () => void, onState: (state: string, info: object) => void}} handlers
   * @param {{getKey: () => string|null, health: () => Promise<object|null>}} options
   */
  constructor(url, handlers, { getKey = () => null, health = fetchHealth } = {}) {
    this.url = url;
    this.h = handlers;
    this.getKey = getKey;
    this.health = health;
    this.ws = null;
    // idle | checking | connecting | open | reconnecting | busy | need_key | idle_closed | closed
    this.state = "idle";
    this.attempt = 0;
    this.everOpened = false;
    this.timer = null;
    this.retryAt = 0;
    this.closedByUs = false;
    this.overloaded = null; // the `overloaded` error of this connection, if the server sent one
    this.generation = 0; // bumps on every connect(): late callbacks of an older try are ignored
  }

  get isOpen() {
    return this.ws !== null && this.ws.readyState === WebSocket.OPEN;
  }

  /** First connection: ask for a key first when the server needs one and none is stored. */
  async start() {
    const generation = ++this.generation;
    this._set("checking");
    const health = await this.health();
    if (generation !== this.generation) return;
    if (health && health.auth_required && !this.getKey()) {
      this._set("need_key", { reason: "required" });
      return;
    }
    this.connect();
  }

  connect() {
    clearTimeout(this.timer);
    const generation = ++this.generation;
    this.closedByUs = false;
    this.overloaded = null;
    this._set(this.attempt === 0 ? "connecting" : "reconnecting");
    const key = this.getKey();
    let url = this.url;
    const protocols = [PROTOCOL];
    if (key && TOKEN.test(key)) protocols.push(KEY_PREFIX + key);
    else if (key) url += `?key=${encodeURIComponent(key)}`;
    let ws;
    try {
      ws = new WebSocket(url, protocols);
    } catch (err) {
      this._set("closed", { reason: `Could not open a connection to ${this.url}: ${err.message}` });
      return;
    }
    ws.binaryType = "arraybuffer";
    this.ws = ws;
    let opened = false;
    ws.onopen = () => {
      opened = true;
      this.attempt = 0;
      this.everOpened = true;
      this._set("open");
      this.h.onOpen();
    };
    ws.onmessage = (e) => {
      if (typeof e.data === "string") {
        let msg;
        try {
          msg = JSON.parse(e.data);
        } catch {
          console.warn("ignoring a non-JSON text frame", e.data);
          return;
        }
        if (msg && msg.type === "error" && msg.code === "overloaded") this.overloaded = msg;
        this.h.onEvent(msg);
      } else {
        this.h.onAudio(e.data);
      }
    };
    // `error` carries no detail in browsers; `close` always follows it, so act there.
    ws.onclose = (e) => {
      if (this.ws !== ws) return;
      this.ws = null;
      if (this.closedByUs) {
        this._set("closed");
        return;
      }
      if (e.code === CLOSE_IDLE) {
        this._set("idle_closed", { code: e.code, reason: e.reason });
        return;
      }
      if (this.overloaded || e.code === CLOSE_OVERLOADED) {
        const hint = this.overloaded && Number(this.overloaded.retry_after_s);
        const delay = Math.max(1, Number.isFinite(hint) && hint > 0 ? hint : OVERLOADED_DEFAULT_S) * 1000;
        this._retry("busy", delay, { code: e.code, message: this.overloaded && this.overloaded.message });
        return;
      }
      if (!opened) {
        this._refusedOrDown(generation, e, Boolean(key));
        return;
      }
      this._backoff({ code: e.code, reason: e.reason, wasOpen: true });
    };
  }

  /** The upgrade failed: a refused key, or no server. Only /healthz can tell which. */
  async _refusedOrDown(generation, e, offeredKey) {
    const health = await this.health();
    if (generation !== this.generation) return; // the user acted meanwhile
    if (health && health.auth_required) {
      this.attempt = 0;
      this._set("need_key", { reason: offeredKey ? "refused" : "required" });
      return;
    }
    this._backoff({ code: e.code, reason: e.reason, wasOpen: this.everOpened, reachable: health !== null });
  }

  _backoff(info) {
    const delay = BACKOFF_MS[Math.min(this.attempt, BACKOFF_MS.length - 1)];
    this.attempt++;
    this._retry("reconnecting", delay, { ...info, attempt: this.attempt });
  }

  _retry(state, delay, info) {
    this.retryAt = Date.now() + delay;
    this._set(state, { ...info, delay });
    const generation = this.generation;
    this.timer = setTimeout(() => {
      if (generation === this.generation) this.connect();
    }, delay);
  }

  /** Seconds until the next automatic try (0 when none is planned). */
  secondsToRetry() {
    if (this.state !== "reconnecting" && this.state !== "busy") return 0;
    return Math.max(0, Math.ceil((this.retryAt - Date.now()) / 1000));
  }

  /** Reconnect now (the user pressed "retry" or "reconnect", or entered a key). */
  retryNow() {
    if (this.state !== "open" && this.state !== "connecting") this.connect();
  }

  send(obj) {
    if (!this.isOpen) return false;
    this.ws.send(JSON.stringify(obj));
    return true;
  }

  sendAudio(buf) {
    if (!this.isOpen) return false;
    // Don't let audio pile up behind a stalled socket: real-time audio that is late is useless.
    if (this.ws.bufferedAmount > 64 * 1024) return false;
    this.ws.send(buf);
    return true;
  }

  close() {
    this.closedByUs = true;
    this.generation++;
    clearTimeout(this.timer);
    if (this.ws) this.ws.close(1000, "bye");
  }

  _set(state, info = {}) {
    this.state = state;
    this.h.onState(state, info);
  }
}
