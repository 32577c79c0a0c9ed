// What the page remembers in this browser. Storage can be missing or full (private
// windows, quotas): every access is guarded, and the page works without it.

export const KEYS = {
  apiKey: "parley.apiKey", // sessionStorage: the API key, for this tab only
  settings: "parley.settings", // localStorage: the settings the user chose (config fields + mic)
  transcript: "parley.transcript", // localStorage: the conversation shown on the page
};

function area(name) {
  try {
    return name === "session" ? window.sessionStorage : window.localStorage;
  } catch {
    return null; // storage disabled
  }
}

export function readJSON(key, fallback, where = "local") {
  try {
    const raw = area(where)?.getItem(key);
    return raw ? JSON.parse(raw) : fallback;
  } catch {
    return fallback;
  }
}

export function writeJSON(key, value, where = "local") {
  try {
    const storage = area(where);
    if (!storage) return false;
    if (value === null || value === undefined) storage.removeItem(key);
    else storage.setItem(key, JSON.stringify(value));
    return true;
  } catch {
    return false; // quota exceeded: keep going without persistence
  }
}

let memoryKey = null; // the key when sessionStorage is unavailable (kept until a reload)

export const apiKey = {
  get() {
    try {
      return area("session")?.getItem(KEYS.apiKey) || memoryKey;
    } catch {
      return memoryKey;
    }
  },
  set(value) {
    memoryKey = value || null;
    try {
      const storage = area("session");
      if (value) storage?.setItem(KEYS.apiKey, value);
      else storage?.removeItem(KEYS.apiKey);
    } catch {
      /* kept in memory only: the user is asked again after a reload */
    }
  },
};
