// The two dialogs of the page: the API key (when the server asks for one) and the settings.
// Both are native <dialog> elements opened with showModal(): focus moves into them, the
// page behind is inert, and Esc closes them.

const $ = (id) => document.getElementById(id);

function openModal(dialog) {
  if (dialog.open) return;
  if (typeof dialog.showModal === "function") dialog.showModal();
  else dialog.setAttribute("open", "");
}

/** Asks for the server's API key; `onKey(key)` is called with what the user entered. */
export class KeyDialog {
  constructor(onKey, onDismiss) {
    this.dialog = $("key-dialog");
    this.form = $("key-form");
    this.input = $("key-input");
    this.error = $("key-error");
    this.form.addEventListener("submit", (e) => {
      e.preventDefault();
      const key = this.input.value.trim();
      if (!key) {
        this._error("Enter the API key first.");
        this.input.focus();
        return;
      }
      this.dialog.close("submitted");
      this.input.value = "";
      onKey(key);
    });
    this.dialog.addEventListener("close", () => {
      if (this.dialog.returnValue !== "submitted") onDismiss();
      this.dialog.returnValue = "";
    });
  }

  get isOpen() {
    return this.dialog.open;
  }

  /** `refused`: the key offered last was not accepted. */
  open({ refused = false } = {}) {
    this._error(refused ? "The server did not accept that key. Check it and try again." : "");
    this.input.setAttribute("aria-invalid", String(refused));
    openModal(this.dialog);
    this.input.focus();
  }

  _error(text) {
    this.error.textContent = text;
    this.error.hidden = !text;
  }
}

/**
 * The settings panel: system prompt, voice, language, barge-in, half-duplex (sent as one
 * `config` message and confirmed by `config_applied`) and the microphone (local only).
 */
export class SettingsDialog {
  /**
   * @param {{onApply: (fields: object, micId: string) => void, listMics: () => Promise<MediaDeviceInfo[]>}} hooks
   */
  constructor({ onApply, listMics }) {
    this.dialog = $("settings-dialog");
    this.form = $("settings-form");
    this.prompt = $("set-prompt");
    this.voice = $("set-voice");
    this.language = $("set-language");
    this.bargeIn = $("set-barge-in");
    this.halfDuplex = $("set-half-duplex");
    this.mic = $("set-mic");
    this.status = $("settings-status");
    this.listMics = listMics;
    this.applied = null;
    this.defaults = null;
    this.micId = "";
    this.form.addEventListener("submit", (e) => {
      e.preventDefault();
      onApply(this.fields(), this.mic.value);
    });
    $("settings-close").addEventListener("click", () => this.dialog.close());
    $("settings-open").addEventListener("click", () => this.open());
    if (navigator.mediaDevices && navigator.mediaDevices.addEventListener) {
      navigator.mediaDevices.addEventListener("devicechange", () => this.refreshMics());
    }
  }

  get isOpen() {
    return this.dialog.open;
  }

  open() {
    if (this.applied) this.show(this.applied);
    this.refreshMics();
    openModal(this.dialog);
    this.prompt.focus();
  }

  /** `ready.voices` / `ready.languages`: what the selects offer. */
  setChoices(voices, languages) {
    fill(this.voice, voices, (v) => v);
    fill(this.language, languages, (l) => (l ? l : "Detect automatically"));
    this.voice.disabled = voices.length < 2;
    this.language.disabled = languages.length < 2;
  }

  /** The server's first `config_applied` of a connection: its defaults (before our settings). */
  setDefaults(applied) {
    this.defaults = applied;
    this.prompt.placeholder = applied.system_prompt;
  }

  /** A `config_applied`: the form shows what the server now uses. */
  show(applied) {
    this.applied = applied;
    const custom = !this.defaults || applied.system_prompt !== this.defaults.system_prompt;
    if (!this.isOpen || !this.form.contains(document.activeElement)) {
      this.prompt.value = custom ? applied.system_prompt : "";
      select(this.voice, applied.voice);
      select(this.language, applied.language);
      this.bargeIn.checked = applied.barge_in;
      this.halfDuplex.checked = applied.half_duplex;
    }
  }

  setStatus(text, kind = "info") {
    this.status.textContent = text;
    this.status.dataset.kind = kind;
  }

  /** The config fields the form holds (an empty prompt means the server's default). */
  fields() {
    const out = { barge_in: this.bargeIn.checked, half_duplex: this.halfDuplex.checked };
    const prompt = this.prompt.value.trim();
    if (prompt) out.system_prompt = prompt;
    else if (this.defaults) out.system_prompt = this.defaults.system_prompt;
    if (this.voice.value) out.voice = this.voice.value;
    if (this.language.options.length) out.language = this.language.value;
    return out;
  }

  /** The microphone list; labels appear once the user has allowed the microphone. */
  async refreshMics() {
    let mics = [];
    try {
      mics = await this.listMics();
    } catch {
      mics = [];
    }
    const current = this.mic.value || this.micId;
    this.mic.replaceChildren(new Option("System default", ""));
    mics.forEach((d, i) => {
      if (d.deviceId === "default" || !d.deviceId) return; // the "" option is the default
      this.mic.append(new Option(d.label || `Microphone ${i + 1}`, d.deviceId));
    });
    select(this.mic, current);
  }

  setMic(id) {
    this.micId = id || "";
    select(this.mic, this.micId);
  }
}

function fill(el, values, label) {
  const current = el.value;
  el.replaceChildren(...values.map((v) => new Option(label(v), v)));
  select(el, current);
}

function select(el, value) {
  if ([...el.options].some((o) => o.value === value)) el.value = value;
}
