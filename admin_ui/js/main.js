// Entry point: sign-in state, navigation, and the router over the pages.

import { api, clearKey, getKey, UNAUTHORIZED_EVENT } from "./api.js";
import { toast } from "./components/toast.js";
import * as adapters from "./pages/adapters.js";
import * as documents from "./pages/documents.js";
import * as engine from "./pages/engine.js";
import * as keys from "./pages/keys.js";
import * as prompts from "./pages/prompts.js";
import * as signin from "./pages/signin.js";
import * as tenants from "./pages/tenants.js";
import * as usage from "./pages/usage.js";
import { createRouter } from "./router.js";

const ROUTES = { adapters, tenants, keys, prompts, documents, usage, engine };
const NARROW = window.matchMedia("(max-width: 760px)");

const main = document.getElementById("main");
const nav = document.getElementById("nav");
const menuToggle = document.getElementById("menu-toggle");
const session = document.getElementById("session");
const whoami = document.getElementById("whoami");
let router = null;
let isFirstRoute = true;

function setMenu(isOpen) {
  menuToggle.setAttribute("aria-expanded", String(isOpen));
  nav.classList.toggle("collapsed", NARROW.matches && !isOpen);
}

function onRoute(name, page) {
  document.title = `${page.title} · loraplex admin`;
  for (const link of nav.querySelectorAll("a[data-route]")) {
    if (link.dataset.route === name) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  setMenu(false);
  // After a navigation, move focus to the new page's heading (screen readers announce it).
  if (!isFirstRoute) queueMicrotask(() => main.querySelector("h1")?.focus());
  isFirstRoute = false;
}

function showApp(me) {
  document.body.classList.add("signed-in");
  nav.hidden = false;
  session.hidden = false;
  whoami.textContent = `Admin key #${me.key_id}`;
  menuToggle.hidden = !NARROW.matches;
  setMenu(false);
  isFirstRoute = true;
  router = createRouter({ routes: ROUTES, fallback: "adapters", container: main, onChange: onRoute });
  router.show();
}

function showSignIn(notice) {
  if (router) router.stop();
  router = null;
  for (const dialog of document.querySelectorAll("dialog")) dialog.remove();  // e.g. a form open when the key was revoked
  document.body.classList.remove("signed-in");
  nav.hidden = true;
  session.hidden = true;
  menuToggle.hidden = true;
  document.title = "Sign in · loraplex admin";
  main.replaceChildren();
  signin.render(main, { notice, onSignedIn: (me) => showApp(me) });
}

async function start() {
  if (!getKey()) {
    showSignIn();
    return;
  }
  try {
    showApp(await api.me());
  } catch (error) {
    clearKey();
    showSignIn(error.status === 401 ? null : error.message);
  }
}

window.addEventListener(UNAUTHORIZED_EVENT, () => {
  if (!router) return;
  clearKey();
  showSignIn("Your admin key is no longer accepted (revoked, or the server's data was reset). Sign in again.");
});

document.getElementById("sign-out").addEventListener("click", () => {
  clearKey();
  showSignIn();
  toast("Signed out.");
});

document.getElementById("skip-link").addEventListener("click", (event) => {
  event.preventDefault();  // keep the route in the hash
  main.focus();
});

menuToggle.addEventListener("click", () => setMenu(menuToggle.getAttribute("aria-expanded") !== "true"));
nav.addEventListener("click", (event) => {
  if (event.target.closest("a")) setMenu(false);  // also when the link is the page already shown
});
document.addEventListener("keydown", (event) => {
  if (event.key !== "Escape" || menuToggle.hidden || menuToggle.getAttribute("aria-expanded") !== "true") return;
  if (document.querySelector("dialog[open]")) return;
  setMenu(false);
  menuToggle.focus();
});
NARROW.addEventListener("change", () => {
  if (router) menuToggle.hidden = !NARROW.matches;
  setMenu(false);
});

start();
