// Progressive enhancement only: every page works without this file.
// Changing a filter drop-down submits the filter form at once.
document.addEventListener("change", (event) => {
  const target = event.target;
  if (target instanceof HTMLSelectElement && target.form && target.form.classList.contains("filters")) {
    target.form.requestSubmit();
  }
});
