// Microphone capture: getUserMedia -> AudioContext -> AudioWorklet -> PCM16 frames.

export const TARGET_RATE = 16000;
const WORKLET_URL = new URL("./mic-worklet.js", import.meta.url);

/** A microphone error with a message a person can act on. */
export class MicError extends Error {
  constructor(code, message) {
    super(message);
    this.code = code;
  }
}

function explain(err) {
  const name = (err && err.name) || "";
  if (name === "NotAllowedError" || name === "SecurityError" || name === "PermissionDeniedError") {
    return new MicError(
      "mic_denied",
      "Microphone access was denied. Allow the microphone for this site (the icon at the left of the address bar), then press the mic button again, or type your question below.",
    );
  }
  if (name === "NotFoundError" || name === "DevicesNotFoundError" || name === "OverconstrainedError") {
    return new MicError("mic_missing", "No microphone was found. Plug one in and press the mic button again, or type your question below.");
  }
  if (name === "NotReadableError" || name === "TrackStartError" || name === "AbortError") {
    return new MicError("mic_busy", "The microphone could not be opened; another application may be using it.");
  }
  return new MicError("mic_error", `The microphone could not be started: ${(err && err.message) || err}`);
}

export class Mic {
  /**
   * @param {(pcm: ArrayBuffer) => void} onFrame  called with ~20 ms of PCM16 at `rate`
   * @param {(level: number) => void} onLevel     RMS 0..1 of each frame, for the meter
   */
  constructor(onFrame, onLevel) {
    this.onFrame = onFrame;
    this.onLevel = onLevel;
    this.ctx = null;
    this.stream = null;
    this.node = null;
    this.rate = TARGET_RATE;
    this.deviceId = "";
    this.fellBack = false;
  }

  /** The audio inputs the browser lists (names only once the microphone was allowed). */
  static async devices() {
    if (!navigator.mediaDevices || !navigator.mediaDevices.enumerateDevices) return [];
    const all = await navigator.mediaDevices.enumerateDevices();
    return all.filter((d) => d.kind === "audioinput");
  }

  get running() {
    return this.ctx !== null;
  }

  /**
   * Must be called from a user gesture (the click), so the AudioContext may start.
   * `deviceId`: the microphone the user picked ("" = the system default). When it is gone
   * (unplugged), the default is used and `fellBack` is set.
   */
  async start(deviceId = "") {
    if (this.running) return this.rate;
    if (!navigator.mediaDevices || !navigator.mediaDevices.getUserMedia) {
      throw new MicError("mic_insecure", "This browser gives no microphone access here. Open the page over https or on localhost.");
    }
    const audio = { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true };
    this.fellBack = false;
    let stream;
    try {
      stream = await navigator.mediaDevices.getUserMedia({
        audio: deviceId ? { ...audio, deviceId: { exact: deviceId } } : audio,
        video: false,
      });
    } catch (err) {
      const gone = deviceId && (err.name === "OverconstrainedError" || err.name === "NotFoundError");
      if (!gone) throw explain(err);
      try {
        stream = await navigator.mediaDevices.getUserMedia({ audio, video: false });
        this.fellBack = true;
      } catch (again) {
        throw explain(again);
      }
    }
    this.deviceId = stream.getAudioTracks()[0]?.getSettings().deviceId || "";
    try {
      await this._wire(stream, true);
    } catch (first) {
      // Some browsers (Firefox) cannot connect a mic to a context at another rate:
      // fall back to the device rate and let the worklet resample to 16 kHz.
      console.warn("16 kHz AudioContext unavailable, resampling in the worklet:", first);
      await this._teardownGraph();
      try {
        await this._wire(stream, false);
      } catch (err) {
        stream.getTracks().forEach((t) => t.stop());
        await this._teardownGraph();
        throw new MicError("mic_error", `Audio capture could not start: ${err.message || err}`);
      }
    }
    this.stream = stream;
    // A track that ends (device unplugged, permission revoked) must not fail silently.
    stream.getAudioTracks().forEach((t) =>
      t.addEventListener("ended", () => this.onEnded && this.onEnded()),
    );
    return this.rate;
  }

  async _wire(stream, at16k) {
    this.ctx = at16k ? new AudioContext({ sampleRate: TARGET_RATE, latencyHint: "interactive" }) : new AudioContext();
    await this.ctx.audioWorklet.addModule(WORKLET_URL);
    const source = this.ctx.createMediaStreamSource(stream);
    this.node = new AudioWorkletNode(this.ctx, "parley-mic", {
      numberOfInputs: 1,
      numberOfOutputs: 0,
      channelCount: 1,
      channelCountMode: "explicit", // downmix a stereo mic to mono
      processorOptions: { targetRate: TARGET_RATE, frameMs: 20 },
    });
    this.node.port.onmessage = (e) => {
      this.onFrame(e.data.pcm);
      this.onLevel(e.data.level);
    };
    source.connect(this.node);
    this.source = source;
    if (this.ctx.state !== "running") await this.ctx.resume();
    this.rate = TARGET_RATE; // the worklet always emits TARGET_RATE
  }

  async _teardownGraph() {
    try {
      if (this.source) this.source.disconnect();
      if (this.node) this.node.port.onmessage = null;
      if (this.ctx) await this.ctx.close();
    } catch {
      /* closing a half-built graph may throw; nothing left to free */
    }
    this.ctx = null;
    this.node = null;
    this.source = null;
  }

  async stop() {
    if (this.stream) this.stream.getTracks().forEach((t) => t.stop());
    this.stream = null;
    await this._teardownGraph();
    this.onLevel(0);
  }
}
