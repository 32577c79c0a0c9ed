// The WebSocket to the server (/ws), with automatic reconnects.
//
// Wire protocol (app/protocol.py is the source of truth): text frames are JSON events,
// binary frames are PCM16 LE audio (mic -> server, reply audio -> page).

const BACKOFF_MS = [500, 1000, 2000, 4000, 8000]; // then stays at the last value

/** ws:// or wss:// to /ws on the page's own host; `?ws=URL` overrides (for testing). */
export function defaultSocketUrl() {
  const override = new URLSearchParams(location.search).get("ws");
  if (override) return override;
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  return `${scheme}//${location.host}/ws`;
}

export class ParleySocket {
  /**
   * @param {string} url
   * @param {{onEvent: (msg: object) => void, onAudio: (buf: ArrayBuffer) => void,
   *          onOpen: () => void, onState: (state: string, info: object) => void}} handlers
   */
  constructor(url, handlers) {
    this.url = url;
    this.h = handlers;
    this.ws = null;
    this.state = "idle"; // idle | connecting | open | reconnecting | closed
    this.attempt = 0;
    this.everOpened = false;
    this.timer = null;
    this.retryAt = 0;
    this.closedByUs = false;
  }

  get isOpen() {
    return this.ws !== null && this.ws.readyState === WebSocket.OPEN;
  }

  connect() {
    clearTimeout(this.timer);
    this.closedByUs = false;
    this._set(this.attempt === 0 ? "connecting" : "reconnecting");
    let ws;
    try {
      ws = new WebSocket(this.url);
    } catch (err) {
      // A malformed URL throws synchronously; retrying would not help.
      this._set("closed", { reason: `Bad server address ${this.url}: ${err.message}` });
      return;
    }
    ws.binaryType = "arraybuffer";
    this.ws = ws;
    ws.onopen = () => {
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
      const delay = BACKOFF_MS[Math.min(this.attempt, BACKOFF_MS.length - 1)];
      this.attempt++;
      this.retryAt = Date.now() + delay;
      this._set("reconnecting", { code: e.code, reason: e.reason, delay, attempt: this.attempt, wasOpen: this.everOpened });
      this.timer = setTimeout(() => this.connect(), delay);
    };
  }

  /** Reconnect now (e.g. the user pressed "retry"). */
  retryNow() {
    if (this.state === "reconnecting" || this.state === "closed") this.connect();
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
    clearTimeout(this.timer);
    if (this.ws) this.ws.close(1000, "bye");
  }

  _set(state, info = {}) {
    this.state = state;
    this.h.onState(state, info);
  }
}
