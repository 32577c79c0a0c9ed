// Gapless playback of streamed PCM16 reply audio.
//
// Each binary frame becomes one AudioBufferSourceNode scheduled to start exactly where
// the previous one ends (a running `nextTime` on the context clock), so chunks neither
// overlap nor leave gaps. If the network falls behind (underrun: the next chunk arrives
// after the previous audio has finished) we restart slightly ahead of "now" rather than
// in the past, which would clip the chunk's start.

const START_LEAD_S = 0.06; // head start for the first chunk / after an underrun
const MIN_LEAD_S = 0.01; // a chunk scheduled closer than this to "now" counts as late

export class Player {
  constructor() {
    this.ctx = null;
    this.turnId = null; // the turn whose audio binary frames belong to
    this.rate = 22050;
    this.chunks = []; // scheduled, not yet fully played: {turnId, start, end, samples, rate, source}
    this.nextTime = 0;
    this.carry = null; // odd trailing byte of a frame (frames should hold whole samples)
    this.dropped = new Set(); // interrupted turns: their late frames are ignored
    this.playedDone = 0; // samples of chunks that finished playing (all turns)
    this.turnPlayedDone = 0; // same, for the current turn only
    this.receivedSamples = 0;
    this.underruns = 0;
  }

  /** Create/resume the output context; call from a user gesture so autoplay allows it. */
  unlock() {
    if (!this.ctx) this.ctx = new AudioContext({ latencyHint: "interactive" });
    if (this.ctx.state !== "running") this.ctx.resume().catch(() => {});
  }

  /** `audio_start`: the binary frames that follow are this turn's audio at `rate`. */
  begin(turnId, rate) {
    if (turnId !== this.turnId) this.turnPlayedDone = 0;
    this.turnId = turnId;
    this.rate = rate;
    this.carry = null;
    this.dropped.delete(turnId);
  }

  /** One binary frame of PCM16 LE mono. */
  push(data) {
    if (this.turnId === null || this.dropped.has(this.turnId)) return;
    this.unlock();
    let bytes = new Uint8Array(data);
    if (this.carry) {
      const joined = new Uint8Array(bytes.length + 1);
      joined[0] = this.carry;
      joined.set(bytes, 1);
      bytes = joined;
      this.carry = null;
    }
    if (bytes.length % 2) {
      this.carry = bytes[bytes.length - 1];
      bytes = bytes.subarray(0, bytes.length - 1);
    }
    const n = bytes.length / 2;
    if (n === 0) return;
    const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
    const buffer = this.ctx.createBuffer(1, n, this.rate); // the context resamples on play
    const ch = buffer.getChannelData(0);
    for (let i = 0; i < n; i++) ch[i] = view.getInt16(2 * i, true) / 32768;
    this.receivedSamples += n;

    const now = this.ctx.currentTime;
    let start = this.nextTime;
    if (start < now + MIN_LEAD_S) {
      // Nothing queued (first chunk) or we ran dry: start a little ahead of now.
      if (this._queuedFor(this.turnId)) this.underruns++;
      start = now + START_LEAD_S;
    }
    const src = this.ctx.createBufferSource();
    src.buffer = buffer;
    src.connect(this.ctx.destination);
    src.start(start);
    const chunk = { turnId: this.turnId, start, end: start + buffer.duration, samples: n, rate: this.rate, source: src };
    this.chunks.push(chunk);
    this.nextTime = chunk.end;
  }

  _queuedFor(turnId) {
    // True when this turn already had audio (so running dry now is an underrun).
    return this.turnPlayedDone > 0 || this.chunks.some((c) => c.turnId === turnId);
  }

  /** Move finished chunks into the played counters. */
  _retire() {
    if (!this.ctx) return;
    const now = this.ctx.currentTime;
    while (this.chunks.length && this.chunks[0].end <= now) {
      const c = this.chunks.shift();
      this.playedDone += c.samples;
      if (c.turnId === this.turnId) this.turnPlayedDone += c.samples;
    }
  }

  _partial(filterTurn) {
    // Samples already played of chunks that are still in the queue (at most one is mid-play).
    const now = this.ctx.currentTime;
    let s = 0;
    for (const c of this.chunks) {
      if (c.start >= now) break;
      if (filterTurn !== undefined && c.turnId !== filterTurn) continue;
      s += Math.min(c.samples, Math.floor((now - c.start) * c.rate));
    }
    return s;
  }

  /** Reply samples actually played so far (all turns), from the context clock. */
  get playedSamples() {
    if (!this.ctx) return 0;
    this._retire();
    return this.playedDone + this._partial();
  }

  /** Milliseconds of the current turn's audio that have played (for `playback`). */
  playedMs(turnId = this.turnId) {
    if (!this.ctx || turnId === null || turnId !== this.turnId) return 0;
    this._retire();
    return ((this.turnPlayedDone + this._partial(turnId)) / this.rate) * 1000;
  }

  /** True while any scheduled audio has not finished. */
  get playing() {
    if (!this.ctx) return false;
    this._retire();
    return this.chunks.length > 0;
  }

  /**
   * Barge-in: silence `turnId` now and forget its queued audio. Returns the ms of the
   * turn that were heard. Sources are stopped at once (not faded) so the cut lands
   * well inside the 100 ms budget.
   */
  interrupt(turnId) {
    const heard = this.playedMs(turnId);
    const partial = this.ctx ? this._partial(turnId) : 0;
    const keep = [];
    for (const c of this.chunks) {
      if (turnId === undefined || c.turnId === turnId) {
        try {
          c.source.stop();
        } catch {
          /* already stopped */
        }
        c.source.disconnect();
      } else {
        keep.push(c);
      }
    }
    this.playedDone += partial;
    if (turnId === undefined || turnId === this.turnId) this.turnPlayedDone += partial;
    this.chunks = keep;
    this.nextTime = keep.length ? keep[keep.length - 1].end : 0;
    if (turnId !== undefined) this.dropped.add(turnId);
    else if (this.turnId !== null) this.dropped.add(this.turnId);
    return heard;
  }
}
