// The console's shell: signing in and out, the sections of each role, and showing errors.
// Views are functions (app, ...route arguments) -> a Node, in the modules imported below.

import * as adapter from "./adapter.js";
import * as admin from "./admin.js";
import { ApiError, call, meta, session } from "./api.js";
import { h } from "./dom.js";
import * as pins from "./pins.js";
import * as tenant from "./tenant.js";
import * as upload from "./upload.js";
import * as usage from "./usage.js";

const SECTIONS = {
  tenant: [
    { path: "adapters", title: "Adapters", view: tenant.adapters, detail: adapter.adapter },
    { path: "upload", title: "Upload", view: upload.view },
    { path: "usage", title: "Usage", view: usage.view },
    { path: "pins", title: "Pins", view: pins.view },
  ],
  admin: [
    { path: "tenants", title: "Tenants", view: admin.tenants, detail: admin.tenant },
    { path: "pools", title: "Pools", view: admin.pools },
  ],
};
// What each role's sign-in check calls (the API decides: a wrong kind of key is 401).
const CHECK = { tenant: "v1/adapters", admin: "v1/tenants" };

const $ = (id) => document.getElementById(id);
const NOTICE_MS = 1500; // a notice outlives the navigation that follows its action, no more
let generation = 0;
let noticeAt = 0;
const loaded = Promise.all([meta("reasons.json"), meta("config.json")]);

/** What views get: the reason sentences, settings, and ways to report back. */
const app = {
  reasons: {},
  config: {},
  notify(message) {
    $("notice").textContent = message;
    noticeAt = Date.now();
  },
  /** A reason code with the API's message, what went wrong in this case, first; the code's
   * general sentence below it (a role=alert box if `alert`). */
  reason(code, message, alert = false) {
    const sentence = app.reasons[code];
    const lead = message || sentence || "";
    return h(
      "div",
      { class: "reason", role: alert ? "alert" : null },
      h("p", { class: "why" }, h("strong", { class: "code" }, code), lead ? `: ${lead}` : ""),
      message && sentence ? h("p", { class: "detail" }, sentence) : null,
    );
  },
  /** How an error is shown; a 401 signs out instead (the key is no longer accepted). */
  problem(error) {
    if (error instanceof ApiError && error.status === 401) {
      signOut(`Signed out: the control plane no longer accepts this key (${error.message}).`);
      return h("span");
    }
    if (!(error instanceof ApiError)) {
      console.error(error);
      return app.reason("Error", String((error && error.message) || error), true);
    }
    return app.reason(error.code, error.message, true);
  },
  /** Run an action (a click, a form) and show its error in `place` (replacing its content). */
  guard(action, place) {
    return async (event) => {
      if (event && event.type === "submit") event.preventDefault();
      try {
        await action(event);
      } catch (error) {
        const box = app.problem(error);
        if (place && session.token()) place.replaceChildren(box);
      }
    };
  },
  refresh: () => render(false),
};

function route() {
  if (!window.location.hash.startsWith("#/")) return [];
  try {
    return window.location.hash.slice(2).split("/").map(decodeURIComponent);
  } catch {
    return [];
  }
}

function navigation(role, current) {
  return SECTIONS[role].map((section) =>
    h(
      "a",
      { href: `#/${section.path}`, "aria-current": section === current ? "page" : null },
      section.title,
    ),
  );
}

async function render(moveFocus) {
  const token = session.token();
  const role = session.role();
  const signedIn = Boolean(token && SECTIONS[role]);
  $("sign-in-view").hidden = signedIn;
  $("view").hidden = !signedIn;
  $("nav").hidden = !signedIn;
  $("who").hidden = !signedIn;
  if (!signedIn) {
    document.title = "Sign in · loraplane console";
    $("view").replaceChildren();
    return;
  }
  const [path, ...args] = route();
  const section = SECTIONS[role].find((s) => s.path === path);
  if (!section) {
    window.location.replace(`#/${SECTIONS[role][0].path}`);
    return;
  }
  $("who-text").textContent =
    role === "admin" ? "Signed in as admin" : `Signed in with key ${token.slice(0, 12)}…`;
  $("nav").replaceChildren(...navigation(role, section));
  const view = $("view");
  const mine = ++generation;
  view.setAttribute("aria-busy", "true");
  if (moveFocus) view.replaceChildren(h("p", { class: "loading" }, "Loading…"));
  await loaded.then(([reasons, config]) => Object.assign(app, { reasons, config }));
  let node;
  try {
    node = args.length && section.detail ? await section.detail(app, ...args) : await section.view(app);
  } catch (error) {
    node = h("div", {}, h("h1", {}, section.title), app.problem(error));
  }
  if (mine !== generation || !session.token()) return;
  view.replaceChildren(node);
  view.removeAttribute("aria-busy");
  const heading = view.querySelector("h1");
  document.title = `${heading ? heading.textContent : section.title} · loraplane console`;
  if (moveFocus && heading) {
    heading.tabIndex = -1;
    heading.focus();
  }
}

function signOut(message) {
  session.clear();
  generation += 1;
  $("notice").textContent = "";
  const error = $("sign-in-error");
  error.textContent = message || "";
  error.hidden = !message;
  if (window.location.hash) window.history.replaceState(null, "", window.location.pathname);
  render(false);
  $("token").focus();
}

async function signIn(event) {
  event.preventDefault();
  const input = $("token");
  const error = $("sign-in-error");
  const token = input.value.trim();
  error.hidden = true;
  if (!token) {
    error.textContent = "Enter your API key or the admin token.";
    error.hidden = false;
    input.focus();
    return;
  }
  // a tenant key starts with lp_ (lp- or LP_: mistyped, its refusal says how); the other kind is
  // tried when the first is refused
  const roles = /^lp[_-]/i.test(token) ? ["tenant", "admin"] : ["admin", "tenant"];
  let first;
  for (const role of roles) {
    try {
      await call("GET", CHECK[role], undefined, token);
      input.value = "";
      session.save(token, role);
      const [path] = route();
      if (SECTIONS[role].some((s) => s.path === path)) render(true);
      else window.location.hash = `#/${SECTIONS[role][0].path}`;
      return;
    } catch (e) {
      first = first || e; // the likelier role's answer says more
      if (e.status !== 401) break;
    }
  }
  error.textContent =
    first.status === 401 ? `Not accepted: ${first.message}.` : `${first.code}: ${first.message}`;
  error.hidden = false;
  input.focus();
}

$("sign-in").addEventListener("submit", signIn);
$("sign-out").addEventListener("click", () => signOut());
document.querySelector(".skip").addEventListener("click", (event) => {
  event.preventDefault(); // "#main" is not a route: focus the content instead
  $("main").focus();
});
window.addEventListener("hashchange", () => {
  if (Date.now() - noticeAt > NOTICE_MS) $("notice").textContent = "";
  render(true);
});
render(false);
