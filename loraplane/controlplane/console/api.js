// The public REST API, called with the signed-in key; and where that key is kept: this tab's
// sessionStorage (never a URL, a cookie or storage that outlives the tab).

const KEYS = {
  token: "loraplane.console.token",
  role: "loraplane.console.role",
  attempts: "loraplane.console.attempts",
};
// The API sits beside the console: /console/ -> /, /prefix/console/ -> /prefix/.
const ROOT = new URL("../", window.location.href).pathname;
const MAX_ATTEMPTS = 20;

export const session = {
  token: () => sessionStorage.getItem(KEYS.token),
  role: () => sessionStorage.getItem(KEYS.role),
  save(token, role) {
    sessionStorage.setItem(KEYS.token, token);
    sessionStorage.setItem(KEYS.role, role);
  },
  clear() {
    for (const key of Object.values(KEYS)) sessionStorage.removeItem(key);
  },
  /** Uploads answered at once in this session (background ones are listed by the API). */
  attempts() {
    try {
      return JSON.parse(sessionStorage.getItem(KEYS.attempts) || "[]");
    } catch {
      return [];
    }
  },
  remember(attempt) {
    const list = [attempt, ...session.attempts()].slice(0, MAX_ATTEMPTS);
    sessionStorage.setItem(KEYS.attempts, JSON.stringify(list));
  },
};

/** An error answer: its HTTP status and the API's `{"error": {"code", "message"}}`. */
export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

/** What an error answer says went wrong: the API's `error.message`; else a framework's
 * `detail` (a string, or pydantic's list of {loc, msg}) or `message`; else the status text. */
export function reasonOf(data, fallback) {
  const error = (data && data.error) || {};
  if (typeof error.message === "string" && error.message) return error.message;
  const detail = data && data.detail;
  if (typeof detail === "string" && detail) return detail;
  if (Array.isArray(detail) && detail.length) {
    return detail
      .map((d) => {
        const where = Array.isArray(d.loc) ? d.loc.filter((p) => p !== "body").join(".") : "";
        return where ? `${where}: ${d.msg}` : String(d.msg || d);
      })
      .join("; ");
  }
  if (data && typeof data.message === "string" && data.message) return data.message;
  return fallback || "no reason given";
}

function failure(status, data, fallback) {
  const error = (data && data.error) || {};
  return new ApiError(status, error.code || `HTTP ${status}`, reasonOf(data, fallback));
}

/** Call `path` (relative to the API root, e.g. "v1/adapters") with `token` (default: the
 * signed-in one); the parsed JSON answer, null for 204, or an ApiError. */
export async function call(method, path, body, token = session.token()) {
  const headers = { Accept: "application/json", Authorization: `Bearer ${token}` };
  const init = { method, headers, credentials: "omit", cache: "no-store" };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(ROOT + path, init);
  } catch {
    throw new ApiError(0, "NetworkError", "the control plane could not be reached");
  }
  if (response.status === 204) return null;
  const data = await response.json().catch(() => null);
  if (!response.ok) throw failure(response.status, data, `${response.status} ${response.statusText}`.trim());
  return data;
}

/** A public file of the console itself (reasons.json, config.json); {} if it fails. */
export async function meta(name) {
  try {
    const response = await fetch(name, { credentials: "omit" });
    return response.ok ? await response.json() : {};
  } catch {
    return {};
  }
}

/** POST a multipart upload with progress: onProgress(sent, total) while the body goes out.
 * Resolves to {status, data} for 200/201/202; rejects with an ApiError otherwise. */
export function upload(form, onProgress) {
  return new Promise((resolve, reject) => {
    const xhr = new XMLHttpRequest();
    xhr.open("POST", `${ROOT}v1/adapters`);
    xhr.setRequestHeader("Authorization", `Bearer ${session.token()}`);
    xhr.setRequestHeader("Accept", "application/json");
    xhr.responseType = "json";
    xhr.upload.addEventListener("progress", (event) => {
      if (event.lengthComputable) onProgress(event.loaded, event.total);
    });
    xhr.addEventListener("load", () => {
      if (xhr.status >= 200 && xhr.status < 300) resolve({ status: xhr.status, data: xhr.response });
      else reject(failure(xhr.status, xhr.response, `${xhr.status} ${xhr.statusText}`.trim()));
    });
    xhr.addEventListener("error", () =>
      reject(new ApiError(0, "NetworkError", "the upload was interrupted")),
    );
    xhr.send(form);
  });
}
