"""The README's test command is what CI runs, and the README keeps exactly two set-up commands."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    """The shell commands of the README's set-up section (```bash blocks under '## Set up')."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    blocks = section.split("```bash\n")[1:]
    return [block.split("```", 1)[0].strip() for block in blocks]


def test_exactly_two_setup_commands():
    commands = readme_commands()
    assert len(commands) == 2
    assert all("\n" not in c for c in commands)


def test_ci_runs_the_readme_test_command():
    test_command = readme_commands()[1]
    assert "pytest" in test_command
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci_lines
