// AudioWorklet processor: turns the microphone's Float32 render quanta (128 samples
// at the context rate) into ~20 ms frames of mono PCM16 at the target rate.
//
// Why a worklet: it runs on the audio thread, so capture never stalls when the main
// thread is busy rendering the chat, and it replaces the deprecated ScriptProcessor.
// Why resample here: some browsers refuse a 16 kHz AudioContext (or refuse to connect
// a 48 kHz microphone to one); then the context runs at the device rate and we
// low-pass + decimate to the target rate before anything leaves the audio thread.

class Resampler {
  // Windowed-sinc low-pass (anti-aliasing) followed by linear interpolation at the
  // fractional output positions. Cheap enough for 48k -> 16k in real time.
  constructor(inRate, outRate) {
    this.ratio = inRate / outRate;
    this.passthrough = inRate === outRate;
    const taps = 31;
    const fc = (0.5 / this.ratio) * 0.9; // cutoff, cycles per input sample
    this.kernel = new Float32Array(taps);
    const mid = (taps - 1) / 2;
    let sum = 0;
    for (let i = 0; i < taps; i++) {
      const x = i - mid;
      const sinc = x === 0 ? 2 * fc : Math.sin(2 * Math.PI * fc * x) / (Math.PI * x);
      const w = 0.42 - 0.5 * Math.cos((2 * Math.PI * i) / (taps - 1)) + 0.08 * Math.cos((4 * Math.PI * i) / (taps - 1));
      this.kernel[i] = sinc * w;
      sum += this.kernel[i];
    }
    for (let i = 0; i < taps; i++) this.kernel[i] /= sum;
    this.history = new Float32Array(taps); // circular FIR state
    this.hpos = 0;
    this.filtered = []; // low-passed input not yet consumed by the interpolator
    this.pos = 0; // fractional read position into `filtered`
  }

  // Returns an array of output samples for this block of input.
  process(input) {
    if (this.passthrough) return input;
    const k = this.kernel;
    const n = k.length;
    for (let j = 0; j < input.length; j++) {
      this.history[this.hpos] = input[j];
      this.hpos = (this.hpos + 1) % n;
      let acc = 0;
      for (let t = 0; t < n; t++) acc += k[t] * this.history[(this.hpos + t) % n];
      this.filtered.push(acc);
    }
    const out = [];
    const buf = this.filtered;
    while (this.pos + 1 < buf.length) {
      const i = Math.floor(this.pos);
      const f = this.pos - i;
      out.push(buf[i] * (1 - f) + buf[i + 1] * f);
      this.pos += this.ratio;
    }
    const used = Math.floor(this.pos);
    if (used > 0) {
      buf.splice(0, used);
      this.pos -= used;
    }
    return out;
  }
}

class MicProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const opts = (options && options.processorOptions) || {};
    this.targetRate = opts.targetRate || sampleRate;
    this.frameSamples = Math.round((this.targetRate * (opts.frameMs || 20)) / 1000);
    this.resampler = new Resampler(sampleRate, this.targetRate);
    this.frame = new Int16Array(this.frameSamples);
    this.fill = 0;
    this.sumSq = 0;
  }

  process(inputs) {
    const input = inputs[0];
    if (!input || input.length === 0 || !input[0]) return true; // no mic yet: keep alive
    const samples = this.resampler.process(input[0]); // channel 0: the mic is mono
    for (let i = 0; i < samples.length; i++) {
      let s = samples[i];
      s = s > 1 ? 1 : s < -1 ? -1 : s;
      this.sumSq += s * s;
      this.frame[this.fill++] = s < 0 ? s * 0x8000 : s * 0x7fff;
      if (this.fill === this.frameSamples) {
        const level = Math.sqrt(this.sumSq / this.frameSamples);
        // Transfer (not copy) the buffer to the main thread, then start a fresh one.
        this.port.postMessage({ pcm: this.frame.buffer, level }, [this.frame.buffer]);
        this.frame = new Int16Array(this.frameSamples);
        this.fill = 0;
        this.sumSq = 0;
      }
    }
    return true;
  }
}

registerProcessor("parley-mic", MicProcessor);
