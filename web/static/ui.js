// Progressive enhancement only: every page works without this file.
// Changing a filter drop-down submits the filter form at once.
document.addEventListener("change", (event) => {
  const target = event.target;
  if (target instanceof HTMLSelectElement && target.form && target.form.classList.contains("filters")) {
    target.form.requestSubmit();
  }
});

// A shortened reference or digest (data-copy holds it whole) gets a button that copies the whole.
for (const element of document.querySelectorAll("[data-copy]")) {
  const button = document.createElement("button");
  button.type = "button";
  button.className = "copy";
  button.textContent = "copy";
  button.title = "Copy " + element.dataset.copy;
  button.setAttribute("aria-label", "Copy the full reference");
  button.addEventListener("click", async () => {
    try {
      await navigator.clipboard.writeText(element.dataset.copy);
      button.textContent = "copied";
    } catch {
      button.textContent = "select it on hover";
    }
    setTimeout(() => { button.textContent = "copy"; }, 1500);
  });
  element.after(" ", button);
}
